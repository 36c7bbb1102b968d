"""The Kubernetes manifests of the docs (snippet kind ``k8s``), checked against the server they run.

A block's YAML documents are read (PyYAML), and what must agree with jaxllm does: the
container's ``jaxllm serve`` command parses with jaxllm's own parser and listens on every
interface; the port it listens on (``--port``, else the parser's default) is the container's,
the probes', the Service's target and the InferencePool's; every probe path is a GET route of
serve/app.py; a pool behind llm-d's picker runs with ``--metrics-compat vllm`` (the names it
reads); the cache folder lies on a mounted volume; selectors select the Deployment's pods and
routes name pools that exist.  So the deployment doc cannot drift from the server.
"""

from __future__ import annotations

import os
import re

import yaml

from jaxllm import cli

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_ROUTE = re.compile(r'@app\.(get|post|delete|put)\("([^"]+)"\)')


def app_routes() -> set[tuple[str, str]]:
    """(METHOD, path) of every route serve/app.py declares."""
    src = open(os.path.join(ROOT, "serve", "app.py"), encoding="utf-8").read()
    return {(m.upper(), path) for m, path in _ROUTE.findall(src)}


def _serve_args(where: str, container: dict):
    argv = [*container.get("command", []), *container.get("args", [])]
    if argv[:2] != ["jaxllm", "serve"]:
        return None
    try:
        return cli.parse_args(cli.build_parser(), [str(a) for a in argv[1:]])
    except SystemExit as e:
        raise AssertionError(f"{where}: `{' '.join(map(str, argv))}` is refused by jaxllm's parser (exit {e.code})")


def _port_of(ref, ports: dict[str, int]) -> int:
    """A port given by number or by the name of a container port."""
    return ports.get(ref, ref) if isinstance(ref, str) else ref


def check(where: str, text: str) -> list[str]:
    """Checks the manifests of one block; returns what was checked (an AssertionError names what is wrong)."""
    docs = [d for d in yaml.safe_load_all(text) if d]
    assert docs, f"{where}: no YAML documents"
    by_kind: dict[str, list[dict]] = {}
    for d in docs:
        assert d.get("apiVersion") and d.get("kind") and d.get("metadata", {}).get("name"), \
            f"{where}: a document without apiVersion, kind or metadata.name: {str(d)[:200]}"
        by_kind.setdefault(d["kind"], []).append(d)
    routes = {path for method, path in app_routes() if method == "GET"}
    report, servers = [], []   # servers: (pod labels, port, args)
    for dep in by_kind.get("Deployment", []):
        pod = dep["spec"]["template"]
        labels = pod["metadata"]["labels"]
        assert dep["spec"]["selector"]["matchLabels"].items() <= labels.items(), \
            f"{where}: Deployment {dep['metadata']['name']}'s selector does not select its pods"
        mounts = {m["name"]: m["mountPath"] for c in pod["spec"]["containers"] for m in c.get("volumeMounts", [])}
        volumes = {v["name"] for v in pod["spec"].get("volumes", [])}
        assert set(mounts) <= volumes, f"{where}: mounts {sorted(set(mounts) - volumes)} have no volume"
        for c in pod["spec"]["containers"]:
            args = _serve_args(where, c)
            if args is None:
                continue
            assert args.host == "0.0.0.0", f"{where}: in a pod `jaxllm serve` listens on --host 0.0.0.0"
            ports = {p.get("name"): p["containerPort"] for p in c.get("ports", [])}
            assert args.port in ports.values(), f"{where}: the container does not expose port {args.port}"
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                get = c.get(probe, {}).get("httpGet")
                assert get, f"{where}: the jaxllm container has no {probe} httpGet"
                assert get["path"] in routes, f"{where}: {probe} path {get['path']} is not a GET route of serve/app.py"
                assert _port_of(get["port"], ports) == args.port, f"{where}: {probe} port is not {args.port}"
                report.append(f"  {probe}: GET {get['path']} on port {args.port} (a route of serve/app.py)")
            env = {e["name"]: e.get("value") for e in c.get("env", [])}
            cache = args.compile_cache_dir or env.get("JAXLLM_CACHE_DIR")
            assert cache and any(cache == p or cache.startswith(p.rstrip("/") + "/") for p in mounts.values()), \
                f"{where}: the cache folder ({cache}) is not on a mounted volume: a restarted pod compiles again"
            report.append(f"  `jaxllm serve` parses; --port {args.port}, cache {cache} on a volume, "
                          f"--metrics-compat {args.metrics_compat}")
            servers.append((labels, args.port, args))
    assert servers, f"{where}: no container runs `jaxllm serve`"

    def served(selector: dict, port: int, what: str):
        hits = [s for s in servers if selector.items() <= s[0].items()]
        assert hits, f"{where}: {what} selects no jaxllm pod"
        assert all(p == port for _, p, _ in hits), f"{where}: {what} sends to port {port}, jaxllm listens on another"
        return hits

    for svc in by_kind.get("Service", []):
        for p in svc["spec"]["ports"]:
            served(svc["spec"]["selector"], p.get("targetPort", p["port"]), f"Service {svc['metadata']['name']}")
            report.append(f"  Service {svc['metadata']['name']}: port {p['port']} -> the pods' {p.get('targetPort')}")
    pools = {}
    for pool in by_kind.get("InferencePool", []):
        name = pool["metadata"]["name"]
        for tp in pool["spec"]["targetPorts"]:
            for _, _, args in served(pool["spec"]["selector"]["matchLabels"], tp["number"], f"InferencePool {name}"):
                assert args.metrics_compat == "vllm", \
                    f"{where}: InferencePool {name}'s pods need --metrics-compat vllm (the picker reads vllm: names)"
        pools[name] = pool
        report.append(f"  InferencePool {name}: targetPorts {[t['number'] for t in pool['spec']['targetPorts']]}, "
                      f"pods with --metrics-compat vllm")
    for route in by_kind.get("HTTPRoute", []):
        for rule in route["spec"]["rules"]:
            for ref in rule["backendRefs"]:
                if ref.get("kind") == "InferencePool":
                    assert ref["name"] in pools, f"{where}: HTTPRoute names a pool {ref['name']} not defined here"
                    report.append(f"  HTTPRoute {route['metadata']['name']} -> InferencePool {ref['name']}")
    return report
