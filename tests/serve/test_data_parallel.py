"""``jaxllm serve --data-parallel-size N``: N engine replicas behind one server.

The routing rule (least unfinished requests, ties to the lowest index, every request's slot
given back however it ends) is tested on the real ``DataParallelEngine`` over fake replicas,
without a device.  The end-to-end test starts ``jaxllm serve -dp 2 --enable-lora`` as a user
would, sends concurrent greedy completions naming the base and two adapters, checks each equals
the single engine's output (an adapter's: transformers + peft's, the LoRA tests' oracle) and
that both replicas served (``jaxllm:request_success_total{engine="0"|"1"}`` in /metrics).
The same server allows runtime LoRA updates: an adapter loaded with ``/v1/load_lora_adapter``
(its folder deleted right after, so a replica that did not read it at load time fails) serves
concurrent requests on both replicas, each equal to transformers + peft; unloaded, a request
naming it is a 404 whichever replica it would go to; neither compiles anything.
"""

from __future__ import annotations

import asyncio
import gc
import os
import re
import shutil
import subprocess
import sys
import threading

import httpx
import pytest

from jaxllm.cli import main
from jaxllm.engine.async_engine import AsyncEngine, FinishedRequestStats, IterationStats, RequestStream, _Abort
from jaxllm.engine.dp_engine import DataParallelEngine
from jaxllm.engine.llm_engine import EngineStats
from jaxllm.engine.output_processor import OutputKind
from jaxllm.engine.processor import InputProcessor
from jaxllm.engine.protocol import EngineClient
from jaxllm.errors import EngineDeadError
from jaxllm.outputs import CompletionOutput, RequestOutput
from jaxllm.sampling_params import SamplingParams

pytest.register_assert_rewrite("support.serve_helpers")  # before its import, so its asserts show values
from support.lora_adapters import ADAPTERS, hf_greedy, save_adapter  # noqa: E402
from support.serve_helpers import free_port, wait_for_health  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# ---------------------------------------------------------------------------- fake replicas


class FakeReplica:
    """What DataParallelEngine uses of an AsyncEngine; the test drives each request's queue."""

    def __init__(self, index: int):
        self.index = index
        self.input_processor = InputProcessor(None, vocab_size=100, max_model_len=64, eos_token_ids=(2,),
                                              max_logprobs=5)
        self.stats_sink = None
        self.dead: str | None = None
        self.queues: dict[str, asyncio.Queue] = {}
        self.aborted: list[str] = []
        """Ids aborted through the engine (``abort``)."""
        self.stream_aborted: list[str] = []
        """Ids aborted through their stream (``RequestStream.abort``)."""
        self.aborted_all = 0

    def check_health(self):
        if self.dead:
            raise EngineDeadError(self.dead)

    @property
    def error(self):
        return RuntimeError(self.dead) if self.dead else None

    def add_request(self, request, *, kind=OutputKind.DELTA):
        if request.prompt_token_ids == BAD:
            raise ValueError("bad prompt")
        q = self.queues[request.request_id] = asyncio.Queue()
        return RequestStream(self, request.request_id, q)

    def _submit(self, cmd):  # RequestStream.abort
        assert isinstance(cmd, _Abort)
        self.stream_aborted.append(cmd.request_id)

    def abort(self, request_id):
        self.aborted.append(request_id)

    def abort_all(self):
        self.aborted_all += 1

    def stats(self):
        i = self.index
        return EngineStats(num_running=i, num_waiting=2 * i, num_free_blocks=10 + i, num_blocks=20,
                           num_preemptions=i,
                           prefix_cache_queries=100 * i, prefix_cache_hits=10 * i, max_loras=2,
                           running_loras=((), ("a",), ("b",))[i % 3], waiting_loras=("c",) if i == 1 else ())

    def send(self, request_id, item):
        self.queues[request_id].put_nowait(item)


def output(request_id: str, finished: bool) -> RequestOutput:
    return RequestOutput(request_id=request_id, prompt="p", prompt_token_ids=[1], prompt_logprobs=None,
                         outputs=[CompletionOutput(index=0, text="x", token_ids=[7], cumulative_logprob=None,
                                                   logprobs=None, finish_reason="length" if finished else None)],
                         finished=finished)


BAD = [66]


def add(dp, request_id, prompt=(1, 2), params=None):
    """What the server does: the input processor makes the request, then it is queued."""
    return dp.add_request(dp.input_processor.process_inputs(request_id, list(prompt),
                                                            params or SamplingParams(max_tokens=4)))


def make_dp(n: int = 3):
    replicas = [FakeReplica(i) for i in range(n)]
    return DataParallelEngine(replicas), replicas


def owner(replicas, request_id) -> int:
    return next(r.index for r in replicas if request_id in r.queues)


def test_least_loaded_routing_and_every_way_a_request_ends():
    async def main():
        dp, reps = make_dp(3)
        s = {rid: add(dp, rid) for rid in ("a", "b", "c", "d")}
        # Empty replicas fill from the lowest index; on a tie the lowest index wins again.
        assert [owner(reps, rid) for rid in "abcd"] == [0, 1, 2, 0]
        assert dp.loads() == [2, 1, 1]

        # Finish: the slot is free once the stream has delivered its final output.
        reps[1].send("b", output("b", finished=False))
        reps[1].send("b", output("b", finished=True))
        assert [o.finished async for o in s["b"]] == [False, True]
        assert dp.loads() == [2, 0, 1]
        s["e"] = add(dp, "e")
        assert owner(reps, "e") == 1 and dp.loads() == [2, 1, 1]

        # Abort through the server (begin_shutdown): the owning replica gets it, the slot is free
        # at once, and the stream's own abort afterwards releases nothing twice.
        dp.abort("a")
        assert reps[0].aborted == ["a"] and dp.loads() == [1, 1, 1]
        s["a"].abort()
        dp.abort("a")  # ended already: a no-op
        assert reps[0].aborted == ["a"] and dp.loads() == [1, 1, 1]

        # Abort through the stream (what `async with` does when a handler leaves early).
        s["c"].abort()
        assert reps[2].stream_aborted == ["c"] and dp.loads() == [1, 1, 0]

        # Client disconnect: the handler's task is cancelled while it awaits the next output.
        async def consume(stream):
            async with stream:
                async for _ in stream:
                    pass

        task = asyncio.ensure_future(consume(s["d"]))
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert reps[0].stream_aborted == ["a", "d"] and dp.loads() == [0, 1, 0]

        # Engine error: the stream raises it and the slot is free.
        reps[1].send("e", EngineDeadError("boom"))
        with pytest.raises(EngineDeadError):
            await s["e"].__anext__()
        assert dp.loads() == [0, 0, 0]

        # A stream dropped without being closed gives its slot back too.
        f = add(dp, "f")
        assert dp.loads() == [1, 0, 0]
        del f
        gc.collect()
        assert dp.loads() == [0, 0, 0] and reps[0].stream_aborted[-1] == "f"

        # A request the replica refuses holds no slot; ids are unique across replicas while open.
        with pytest.raises(ValueError, match="bad prompt"):
            add(dp, "g", BAD)
        g = add(dp, "g")
        with pytest.raises(ValueError, match="already in use"):
            add(dp, "g")
        assert dp.loads() == [1, 0, 0]
        reps[0].send("g", output("g", finished=True))
        assert [o.finished async for o in g] == [True]
        g2 = add(dp, "g")  # free again once finished
        g.abort()  # the old stream cannot release the new request's slot
        assert dp.loads() == [1, 0, 0]

        dp.abort_all()
        assert dp.loads() == [0, 0, 0] and all(r.aborted_all == 1 for r in reps)
        g2.abort()
        assert dp.loads() == [0, 0, 0]

    asyncio.run(main())


def test_health_stats_and_per_replica_metrics():
    from serve.metrics import Metrics

    dp, reps = make_dp(3)
    s = dp.stats()
    assert (s.num_running, s.num_waiting, s.num_free_blocks, s.num_blocks, s.num_preemptions) == (3, 6, 33, 60, 3)
    assert (s.prefix_cache_queries, s.prefix_cache_hits) == (300, 30)
    assert (s.max_loras, s.running_loras, s.waiting_loras) == (2, ("a", "b"), ("c",))   # the union
    assert [x.num_running for x in dp.replica_stats()] == [0, 1, 2]

    dp.check_health()
    reps[1].dead = "the engine failed and stopped: boom"
    with pytest.raises(EngineDeadError, match="replica 1 of 3.*boom"):
        dp.check_health()
    with pytest.raises(EngineDeadError, match="replica 1 of 3"):
        asyncio.run(_add(dp))
    assert dp.loads() == [0, 0, 0] and str(dp.error) == reps[1].dead

    # The sink set on the DP engine reaches every replica, each recording under its own label.
    metrics = Metrics("m")
    dp.stats_sink = metrics
    assert dp.stats_sink is metrics
    fin = FinishedRequestStats("x", "length", 3, 4, 0.5, 0.1)
    for i in (1, 2, 2):
        reps[i].stats_sink.record(IterationStats(engine=reps[i].stats(), num_prompt_tokens=3,
                                                 num_generation_tokens=4, time_to_first_token=(0.1,),
                                                 inter_token_latency=(), finished=(fin,)))
    assert [metrics.finished_count("length", engine=i) for i in range(3)] == [0, 1, 2]
    assert metrics.finished_count("length") == 3
    text = metrics.render().decode()
    assert 'jaxllm:num_requests_running{engine="2",model_name="m"} 2.0' in text
    assert 'jaxllm:prefix_cache_queries_total{engine="1",model_name="m"} 100.0' in text
    # One LoRA series for the server: the adapters of every replica that recorded (1, then 2).
    info = [line for line in text.splitlines() if line.startswith("jaxllm:lora_requests_info{")]
    assert len(info) == 1 and 'max_lora="2",running_lora_adapters="a,b",waiting_lora_adapters="c"' in info[0], info
    dp.stats_sink = None
    assert all(r.stats_sink is None for r in reps)


async def _add(dp):
    return add(dp, "z")


def test_one_engine_and_data_parallel_offer_the_same_interface():
    """serve/ uses EngineClient only, so both engines must implement every part of it."""
    members = [m for m in dir(EngineClient) if not m.startswith("_")] + list(EngineClient.__annotations__)
    assert {"input_processor", "add_request", "abort", "replica_stats", "check_health", "stats_sink",
            "prefix_caching", "max_model_len", "shutdown"} <= set(members)
    for m in members:
        assert hasattr(AsyncEngine, m) or m == "stats_sink", m   # stats_sink: an instance attribute
        assert hasattr(DataParallelEngine, m), m


class FakeStore:
    """A replica's AdapterStore as the registry uses it: ``get`` reads (or refuses), ``drop`` forgets."""

    def __init__(self, refuse: bool = False):
        self.refuse = refuse
        self.held: set[int] = set()

    def get(self, lora):
        if self.refuse:
            raise ValueError(f"LoRA adapter at lora_path={lora.lora_path!r}: no such folder")
        self.held.add(lora.lora_int_id)

    def drop(self, lora_int_id):
        held = lora_int_id in self.held
        self.held.discard(lora_int_id)
        return held


def test_runtime_lora_load_reaches_every_replica_or_none():
    from serve.lora import LoRARegistry

    stores = [FakeStore(), FakeStore(), FakeStore()]
    reg = LoRARegistry(stores, "tiny")
    lora = reg.add("c8", "/adapters/c8")
    assert [s.held for s in stores] == [{lora.lora_int_id}] * 3 and reg.names() == ["c8"]
    # The last replica refuses: the error is the load's (a 400 naming lora_path), and the
    # replicas that read it before forget it.
    stores[2].refuse = True
    with pytest.raises(ValueError, match="lora_path="):
        reg.add("d8", "/adapters/d8")
    assert [s.held for s in stores] == [{lora.lora_int_id}] * 3 and reg.names() == ["c8"]
    assert not LoRARegistry((), "tiny").enabled


def test_offline_llm_refuses_data_parallel():
    from jaxllm import LLM
    with pytest.raises(ValueError, match=r"jaxllm serve -dp"):
        LLM(data_parallel_size=2)


# ---------------------------------------------------------------------------- end to end


# Fewer buckets than the tiny_llm reference's SMALL_ENGINE (each replica compiles its own, and
# a CPU program is keyed by its device, so replica 1 shares nothing with replica 0): greedy
# outputs do not depend on batching (tests/engine/test_batching.py).  A 2-token budget makes
# two step buckets per replica, (1, 1) and (2, 2): the prompts go in 2-token chunks, and two
# requests decode together in one step.
SERVE_FLAGS = ["--max-num-seqs", "2", "--max-num-batched-tokens", "2", "--max-model-len", "256",
               "--dtype", "float32"]


def test_bad_data_parallel_size_exits_2(tiny_llama, capsys):
    # In this process: the size is checked with the flags, before JAX or the weights load.
    assert main(["serve", tiny_llama, "-dp", "0"]) == 2
    assert "--data-parallel-size must be a positive integer, got 0" in capsys.readouterr().err


@pytest.fixture(scope="module")
def adapters(tiny_llama, tmp_path_factory):
    """Three peft adapters of the tiny Llama (ranks 4, 8, 8): name -> folder (c8 is loaded at runtime)."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    root = tmp_path_factory.mktemp("dp_lora")
    return {n: save_adapter(model, str(root / n), seed=i + 1, **ADAPTERS[n]) for i, n in enumerate(("a4", "b8", "c8"))}


def served_per_replica(base: str) -> tuple[dict[str, float], str]:
    """``{engine label: requests finished by length}`` from /metrics, and the metrics text."""
    metrics = httpx.get(base + "/metrics", timeout=10).text
    served: dict[str, float] = {}
    for m in re.finditer(r'^jaxllm:request_success_total\{(.*)\} (\S+)$', metrics, re.M):
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
        if labels["finished_reason"] == "length":
            served[labels["engine"]] = float(m.group(2))
    return served, metrics


def concurrent_completions(base: str, bodies: list[dict]) -> list:
    """POSTs every body to /v1/completions at once (a barrier), one thread each; the responses."""
    results: list = [None] * len(bodies)
    barrier = threading.Barrier(len(bodies))

    def one(i):
        with httpx.Client(base_url=base, timeout=120) as c:
            barrier.wait()
            results[i] = c.post("/v1/completions", json=bodies[i])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    return results


def test_serve_dp2_outputs_equal_one_engine_and_both_replicas_serve(tiny_llama, tiny_llm, adapters, tmp_path):
    port = free_port()
    static = {n: adapters[n] for n in ("a4", "b8")}
    # --max-cpu-loras 3: every replica keeps the runtime adapter read (the static two and it).
    cmd = [sys.executable, "-m", "jaxllm.cli", "serve", tiny_llama, "--host", "127.0.0.1", "--port", str(port),
           "--served-model-name", "tiny", "--data-parallel-size", "2", *SERVE_FLAGS,
           "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8", "--max-cpu-loras", "3",
           "--lora-modules", *(f"{n}={p}" for n, p in static.items())]
    env = {**os.environ, "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    base = f"http://127.0.0.1:{port}"

    # The reference, computed while the server starts: the single shared engine, greedy.
    n = 8
    prompts = [[11 + i, 40 + 3 * i, 7, 300 + i] * (1 + i % 3) for i in range(n)]
    max_tokens = 24  # long enough that the concurrent requests overlap
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    ref = [o.outputs[0].token_ids for o in tiny_llm.generate([{"prompt_token_ids": p} for p in prompts], sp,
                                                             use_tqdm=False)]
    # Every third request names no adapter, the others a4 or b8 (concurrent, so both replicas
    # batch adapters with the base); an adapter's reference: transformers + peft, greedy, its
    # first n_lora tokens (the LoRA tests' token-exact length, tests/lora/test_engine.py N).
    model_of = ["tiny", "a4", "b8"]
    n_lora = 8
    peft_ref = hf_greedy(tiny_llama, adapters, prompts, n_lora)
    changed = [peft_ref[(model_of[i % 3], i)] != ref[i][:n_lora] for i in range(n) if i % 3]
    assert any(changed), "the adapters leave the tiny model's tokens as they were"
    base_ref = [t[:n_lora] for t in ref]
    for i in range(n):
        if i % 3:
            ref[i] = peft_ref[(model_of[i % 3], i)]
    try:
        wait_for_health(proc, base, lines, timeout=240)

        results = concurrent_completions(base, [
            {"model": model_of[i % 3], "prompt": prompts[i], "max_tokens": max_tokens if i % 3 == 0 else n_lora,
             "temperature": 0, "ignore_eos": True, "return_token_ids": True} for i in range(n)])
        for i, r in enumerate(results):
            assert r is not None and r.status_code == 200, (i, r and r.text)
            assert r.json()["choices"][0]["token_ids"] == ref[i], f"prompt {i} ({model_of[i % 3]}) differs"

        served, metrics = served_per_replica(base)
        assert sum(served.values()) == n, metrics
        assert served.get("0", 0) > 0 and served.get("1", 0) > 0, f"requests per replica: {served}"
        for g in ("jaxllm:num_requests_running", "jaxllm:num_requests_waiting"):
            vals = re.findall(rf'^{g}\{{.*\}} (\S+)$', metrics, re.M)
            assert len(vals) == 2 and all(float(v) == 0 for v in vals), (g, vals)

        # Runtime load: the adapter's folder is gone once the load answered, so a replica that
        # was not given it at load time cannot read it when a request names it.
        runtime = str(tmp_path / "c8")
        shutil.copytree(adapters["c8"], runtime)
        r = httpx.post(base + "/v1/load_lora_adapter", json={"lora_name": "c8", "lora_path": runtime}, timeout=60)
        assert r.status_code == 200, r.text
        shutil.rmtree(runtime)
        k = 4   # concurrent: two per replica
        c8_ref = [peft_ref[("c8", i)] for i in range(k)]
        assert any(c8_ref[i] != base_ref[i] for i in range(k)), "c8 leaves the tiny model's tokens as they were"
        results = concurrent_completions(base, [
            {"model": "c8", "prompt": prompts[i], "max_tokens": n_lora, "temperature": 0, "ignore_eos": True,
             "return_token_ids": True} for i in range(k)])
        for i, r in enumerate(results):
            assert r is not None and r.status_code == 200, (i, r and r.text)
            assert r.json()["choices"][0]["token_ids"] == c8_ref[i], f"prompt {i} (runtime c8) differs"
        after, metrics = served_per_replica(base)
        assert sum(after.values()) == n + k, metrics
        assert after.get("0", 0) > served.get("0", 0) and after.get("1", 0) > served.get("1", 0), \
            f"c8 requests per replica: {served} -> {after}"

        # Unload: the name is gone for every replica (k concurrent requests, so both would get one).
        r = httpx.post(base + "/v1/unload_lora_adapter", json={"lora_name": "c8"}, timeout=60)
        assert r.status_code == 200, r.text
        results = concurrent_completions(base, [{"model": "c8", "prompt": prompts[i], "max_tokens": 2}
                                                for i in range(k)])
        assert [r.status_code for r in results] == [404] * k, [r.text for r in results]
        assert served_per_replica(base)[0] == after
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        reader.join(5)
    log = "".join(lines)
    assert "data parallel: 2 replicas" in log, log
    assert "programs after warm-up" not in log, log   # loading, serving and unloading c8 compiled nothing
    assert proc.returncode == 0, log
