"""Hub model ids: a model argument that is not a local path names a Hugging Face Hub repo, as
vLLM takes it (``Qwen/Qwen3-0.6B``), or one GGUF file of a repo, as llama.cpp and vLLM take it
(``org/repo:Q4_K_M``, or ``--gguf-file NAME``).  :func:`resolve` turns it into local files:
it downloads what the engine reads (config, tokenizer files, safetensors and their index,
chat template, generation_config; or the one GGUF) into the Hugging Face cache (or
``--download-dir``), or, with ``HF_HUB_OFFLINE=1`` or when the Hub cannot be reached, takes
them from that cache.  ``HF_TOKEN`` and ``HF_ENDPOINT`` are read when it runs.

Every failure a user can fix (no such repo, a gated or private repo without a token, no
network, offline with nothing cached) is a :class:`HubError` of one line naming the cause."""

from __future__ import annotations

import fnmatch
import logging
import os
import re
import socket
import sys
import threading
import time

from jaxllm.errors import JaxllmError

log = logging.getLogger("jaxllm.hub")

HF_FILES = ("*.json", "*.safetensors", "merges.txt", "vocab.txt", "*.model", "*.tiktoken", "*.jinja")
"""What an HF checkpoint's engine start reads, matched against the repo's top-level file names:
config.json, generation_config.json, the tokenizer's files, chat_template.json/.jinja, the
safetensors and model.safetensors.index.json (never the .bin / .pt / ONNX copies beside them)."""

TOKENIZER_EXCLUDE = ("*.safetensors", "*.safetensors.index.json")
"""What a ``--tokenizer`` Hub id does not download of :data:`HF_FILES`: the weights."""

KINDS = ("model", "tokenizer")

_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*(/[A-Za-z0-9_.-]+)?$")
_SPLIT_GGUF = re.compile(r"-\d{5}-of-\d{5}\.gguf$")


class HubError(JaxllmError, ValueError):
    """A Hub model id that cannot be resolved; the message names the cause in one line."""


def is_hub_id(model: str | None) -> bool:
    """Whether ``model`` is read as a Hub repo id (``org/name`` or ``org/name:QUANT``): not None,
    not an existing local path, and shaped like one (a path that merely does not exist, such
    as ``./x``, ``/a/b/c`` or ``m.gguf``, is not)."""
    if not isinstance(model, str) or os.path.exists(model):
        return False
    repo, _ = split_quant(model)
    return bool(_REPO_ID.match(repo)) and ".." not in repo and "--" not in repo and not repo.endswith(".gguf")


def split_quant(model: str) -> tuple[str, str | None]:
    """``org/repo:Q4_K_M`` -> (``org/repo``, ``Q4_K_M``); no tag -> (model, None)."""
    repo, sep, tag = model.rpartition(":")
    return (repo, tag) if sep and repo and tag else (model, None)


def check_args(model: str | None, revision: str | None, download_dir: str | None, gguf_file: str | None,
               tokenizer: str | None = None, tokenizer_revision: str | None = None) -> None:
    """The Hub flags checked before anything loads (ValueError naming the flag)."""
    if tokenizer_revision is not None:
        if not isinstance(tokenizer_revision, str) or not tokenizer_revision.strip():
            raise ValueError(f"--tokenizer-revision must be a non-empty string, got {tokenizer_revision!r}")
        if not is_hub_id(tokenizer if tokenizer is not None else model):
            raise ValueError(f"--tokenizer-revision {tokenizer_revision} picks a version of a Hub repo; the "
                             f"tokenizer {tokenizer or model or '(the built-in model)'} is not a Hub id")
    for flag, value in (("--revision", revision), ("--download-dir", download_dir), ("--gguf-file", gguf_file)):
        if value is not None and (not isinstance(value, str) or not value.strip()):
            raise ValueError(f"{flag} must be a non-empty string, got {value!r}")
    hub = is_hub_id(model)
    if revision is not None and not hub:
        raise ValueError(f"--revision {revision} picks a version of a Hub repo; the model "
                         f"{model or '(the built-in model)'} is not a Hub id")
    if gguf_file is not None:
        if not hub:
            raise ValueError(f"--gguf-file {gguf_file} picks a file of a Hub repo; the model "
                             f"{model or '(the built-in model)'} is not a Hub id (pass a local .gguf file as "
                             "the model)")
        if not gguf_file.endswith(".gguf"):
            raise ValueError(f"--gguf-file {gguf_file}: expected the name of a .gguf file in the repo")
        if split_quant(model)[1] is not None:
            raise ValueError(f"the model {model} picks a GGUF by its tag and --gguf-file {gguf_file} picks "
                             "another way: give one")
    if download_dir is not None and os.path.exists(download_dir) and not os.path.isdir(download_dir):
        raise ValueError(f"--download-dir {download_dir} is a file, not a folder")


_resolved: dict[tuple, str] = {}
_lock = threading.Lock()


def resolve(model: str | None, revision: str | None = None, download_dir: str | None = None,
            gguf_file: str | None = None, *, kind: str = "model", flag: str | None = None) -> str | None:
    """The local HF folder or .gguf file for ``model``: None and local paths as they are; a Hub
    id downloaded (or found in the cache) first.  Resolved once per process for the same
    arguments and environment (data-parallel replicas share one download).

    ``kind="tokenizer"`` takes only the tokenizer's files (no weights) of an HF repo.  ``flag``
    names where the id came from (``--tokenizer``, ``--speculative-config model``): each failure's
    line starts with it, so that a user knows which of two ids failed."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if not is_hub_id(model):
        return model
    offline = _offline()
    download_dir = None if download_dir is None else os.path.expanduser(download_dir)
    endpoint = (os.environ.get("HF_ENDPOINT") or "").rstrip("/") or None
    key = (model, revision, download_dir, gguf_file, offline, endpoint, kind)
    with _lock:
        if key not in _resolved:
            try:
                _resolved[key] = _Resolver(model, revision, download_dir, gguf_file, offline, endpoint, kind,
                                           flag).run()
            except HubError as e:
                if flag is None or str(e).startswith(flag):
                    raise
                raise HubError(f"{flag} {model}: {e}") from None
            log.info("Hub %s %s%s: %s", kind, model, f"@{revision}" if revision else "", _resolved[key])
        return _resolved[key]


def _offline() -> bool:
    from huggingface_hub import constants   # ~0.2 s: imported by a start that needs it, not by the CLI parser
    return constants.is_offline_mode() or os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE")


def _size(n: int | None) -> str:
    if n is None:
        return "size unknown"
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


class _Resolver:
    """One resolution: the repo's file list (online) or its cached snapshot (offline), the
    files to take from it, and their download."""

    def __init__(self, model, revision, download_dir, gguf_file, offline, endpoint, kind="model", flag=None):
        from huggingface_hub import constants
        self.repo, self.quant = split_quant(model)
        self.kind, self.label = kind, flag or "model"
        self.revision, self.cache_dir, self.gguf_file = revision, download_dir, gguf_file
        self.offline, self.endpoint = offline, endpoint
        # read now, not at huggingface_hub's import; None: its own lookup (a saved login)
        self.token = os.environ.get("HF_TOKEN") or None
        self.shown_endpoint = endpoint or constants.ENDPOINT
        self.where = self.repo + (f"@{revision}" if revision else "")
        pick = gguf_file or self.quant
        self.asked = self.where + (f" ({pick})" if pick else "")   # what was asked, for the cache's messages

    def run(self) -> str:
        if self.offline:
            return self._from_cache(f"HF_HUB_OFFLINE is set and the cache ({self._cache()}) lacks {self.asked}: "
                                    "run once online first, or unset HF_HUB_OFFLINE")
        try:
            files = self._list_files()
        except Exception as e:   # noqa: BLE001 - every huggingface_hub / httpx failure gets its one line
            if not _is_connection_error(e):
                raise HubError(self._explain(e)) from None
            unreachable = (f"cannot reach the Hub at {self.shown_endpoint} to get {self.asked} "
                           f"({_cause(e)}), and the cache ({self._cache()}) lacks it: check the network "
                           "or HF_ENDPOINT")
            path = self._from_cache(unreachable)
            log.warning("cannot reach the Hub at %s (%s): using the cached %s", self.shown_endpoint, _cause(e),
                        self.asked)
            return path
        wanted = self._pick(files)
        try:
            paths = self._download(wanted, files)
        except Exception as e:   # noqa: BLE001
            raise HubError(self._explain(e)) from None
        return paths[wanted[0]] if self._gguf_wanted(files) else os.path.dirname(paths[wanted[0]])

    # ---------------------------------------------------------------- which files

    def _gguf_wanted(self, names) -> bool:
        if self.quant is not None or self.gguf_file is not None:
            return True
        if self.kind == "tokenizer":   # a tokenizer repo may hold no config.json
            return not any(n in names for n in ("config.json", "tokenizer.json", "tokenizer_config.json"))
        return "config.json" not in names

    def _pick(self, files: dict[str, int | None]) -> list[str]:
        """The files to download: the one GGUF asked for, else the HF checkpoint's files."""
        names = sorted(files)
        if not self._gguf_wanted(names):
            skip = TOKENIZER_EXCLUDE if self.kind == "tokenizer" else ()
            first = [n for n in ("config.json", "tokenizer_config.json", "tokenizer.json") if n in names][:1]
            return first + [n for n in names if n not in first and "/" not in n
                            and any(fnmatch.fnmatchcase(n, p) for p in HF_FILES)
                            and not any(fnmatch.fnmatchcase(n, p) for p in skip)]
        return [self._pick_gguf(names)]

    def _pick_gguf(self, names: list[str]) -> str:
        ggufs = [n for n in names if n.endswith(".gguf") and "mmproj" not in os.path.basename(n).lower()]
        if self.gguf_file is not None:
            if self.gguf_file not in names:
                raise HubError(f"--gguf-file {self.gguf_file}: {self.where} has no such file "
                               f"(its GGUF files: {', '.join(ggufs) or 'none'})")
            return self.gguf_file
        if self.quant is not None:
            tag = re.compile(rf"(?<![A-Za-z0-9]){re.escape(self.quant)}(?![A-Za-z0-9_])", re.IGNORECASE)
            ggufs = [n for n in ggufs if tag.search(os.path.basename(n))]
            if not ggufs:
                raise HubError(f"{self.where} has no GGUF file tagged {self.quant} (its GGUF files: "
                               f"{', '.join(n for n in names if n.endswith('.gguf')) or 'none'})")
        elif not ggufs:
            what = ("a tokenizer (tokenizer.json, tokenizer_config.json)" if self.kind == "tokenizer"
                    else "an HF checkpoint (config.json)")
            raise HubError(f"{self.where} holds neither {what} nor a .gguf file")
        if any(_SPLIT_GGUF.search(n) for n in ggufs):
            raise HubError(f"{self.where}: {ggufs[0]} is a GGUF split into parts, which is not supported: "
                           "merge them (llama-gguf-split --merge) and pass the file")
        if len(ggufs) > 1:
            raise HubError(f"{self.where} holds {len(ggufs)} GGUF files: pick one with {self.repo}:QUANT "
                           f"or --gguf-file NAME ({', '.join(ggufs)})")
        return ggufs[0]

    def _list_files(self) -> dict[str, int | None]:
        from huggingface_hub import HfApi
        info = HfApi(endpoint=self.endpoint).model_info(self.repo, revision=self.revision, files_metadata=True,
                                                                token=self.token)
        return {s.rfilename: s.size for s in info.siblings or ()}

    # ---------------------------------------------------------------- getting them

    def _download(self, wanted: list[str], sizes: dict[str, int | None]) -> dict[str, str]:
        """Each file through ``hf_hub_download`` (resumable, checked against its ETag): its
        own bar on a terminal, else one log line per file fetched."""
        from huggingface_hub import hf_hub_download, try_to_load_from_cache
        tty = sys.stderr is not None and sys.stderr.isatty()
        todo = [n for n in wanted if not isinstance(try_to_load_from_cache(
            self.repo, n, cache_dir=self.cache_dir, revision=self.revision), str)]
        if todo:
            log.info("downloading %s from %s: %d file(s), %s, to %s", self.where, self.shown_endpoint, len(todo),
                     _size(sum(sizes.get(n) or 0 for n in todo)), self._cache())
        quiet = _no_bar_class()
        t0 = time.perf_counter()
        paths = {}
        for name in wanted:
            if name in todo and not tty:
                log.info("downloading %s (%s)", name, _size(sizes.get(name)))
            paths[name] = hf_hub_download(self.repo, name, revision=self.revision, cache_dir=self.cache_dir,
                                          endpoint=self.endpoint, token=self.token,
                                          tqdm_class=None if tty else quiet)
        if todo:
            log.info("downloaded %s in %.1f s", self.where, time.perf_counter() - t0)
        return paths

    def _from_cache(self, missing: str) -> str:
        """The cached snapshot (offline, or the Hub unreachable): the GGUF asked for, or the folder."""
        from huggingface_hub import snapshot_download
        try:
            folder = snapshot_download(self.repo, revision=self.revision, cache_dir=self.cache_dir,
                                       local_files_only=True)
        except Exception:   # noqa: BLE001 - LocalEntryNotFoundError and its kin: not cached
            raise HubError(missing) from None
        names = [os.path.relpath(os.path.join(d, f), folder).replace(os.sep, "/")
                 for d, _, fs in os.walk(folder) for f in fs]
        if not self._gguf_wanted(names):
            return folder
        try:
            return os.path.join(folder, self._pick_gguf(names))
        except HubError as e:
            raise HubError(f"{missing} ({e})") from None

    def _cache(self) -> str:
        from huggingface_hub import constants
        return self.cache_dir or constants.HF_HUB_CACHE

    def _explain(self, e: Exception) -> str:
        """One line naming why the Hub refused (or could not be reached)."""
        from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, RepositoryNotFoundError,
                                            RevisionNotFoundError)
        status = getattr(getattr(e, "response", None), "status_code", None)
        token = " (HF_TOKEN is set: does it have access?)" if os.environ.get("HF_TOKEN") else ""
        if isinstance(e, HubError):
            return str(e)
        if isinstance(e, GatedRepoError):
            return (f"{self.where} is a gated repo on {self.shown_endpoint} (HTTP {status}): accept its terms on "
                    f"its Hub page and set HF_TOKEN to a token of that account{token}")
        if isinstance(e, RevisionNotFoundError):
            return f"{self.repo} has no revision {self.revision!r} on {self.shown_endpoint}"
        if isinstance(e, RepositoryNotFoundError) and status == 404:
            return (f"{self.label} {self.repo!r} is not a local path and no Hub repo {self.repo} exists on "
                    f"{self.shown_endpoint} (HTTP 404)")
        if isinstance(e, (RepositoryNotFoundError, HfHubHTTPError)) and status in (401, 403):
            return (f"{self.where} on {self.shown_endpoint} is private or gated (HTTP {status}): set HF_TOKEN to a "
                    f"token with access{token}")
        if _is_connection_error(e):
            return f"cannot reach the Hub at {self.shown_endpoint} to get {self.where} ({_cause(e)})"
        return f"cannot get {self.where} from {self.shown_endpoint}: {_cause(e)}"


def _is_connection_error(e: BaseException) -> bool:
    """Whether ``e`` (or what caused it) says the Hub could not be reached, rather than answered."""
    from huggingface_hub.errors import LocalEntryNotFoundError, OfflineModeIsEnabled
    if getattr(getattr(e, "response", None), "status_code", None) is not None:
        return False   # the Hub answered
    while e is not None:
        # huggingface_hub's HTTP client raises its own TransportError family (connect, timeout, DNS)
        if isinstance(e, (LocalEntryNotFoundError, OfflineModeIsEnabled, ConnectionError, TimeoutError,
                          socket.gaierror)) or any(c.__name__ == "TransportError" for c in type(e).__mro__):
            return True
        e = e.__cause__ or e.__context__
    return False


def _cause(e: BaseException) -> str:
    """The innermost exception's first line: ``ConnectError: [Errno 111] Connection refused``."""
    while e.__cause__ is not None or e.__context__ is not None:
        e = e.__cause__ or e.__context__
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


def _no_bar_class():
    from huggingface_hub.utils import tqdm

    class NoBar(tqdm):
        """huggingface_hub's bar, off: a log file gets one line per file instead of ``\\r`` updates."""

        def __init__(self, *args, **kwargs):
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)

    return NoBar

