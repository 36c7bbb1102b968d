"""LoRA on the server (serve/lora.py), vLLM's surface: the official openai client selects an
adapter with ``model`` and gets the offline ``LLM``'s tokens for that ``LoRARequest``;
``/v1/models`` lists the adapters; runtime load / use / unload without compiling;
``jaxllm:lora_requests_info`` names the adapter of a running request; bad
adapters refused by name (400, ``lora_path``) while another request completes; the flags'
errors.

One server for the file: the tiny Llama with two adapters from ``--lora-modules`` (a4, b8 of
tests/support/lora_adapters.py) and runtime updating allowed.  The offline engine has the same
settings, so its programs come from the run's compile cache."""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest

pytest.register_assert_rewrite("support.serve_helpers")

from support.engines import ONE_SHOT_ENGINE  # noqa: E402
from support.gie_metrics import families  # noqa: E402
from support.lora_adapters import build_set, edit_config  # noqa: E402
from support.serve_helpers import ServerThread, assert_error_shape, make_engine  # noqa: E402

from jaxllm import LLM, LoRARequest, SamplingParams  # noqa: E402
from jaxllm.cli import main  # noqa: E402
from jaxllm.config import ServingConfig  # noqa: E402
from jaxllm.runner import compile as cc  # noqa: E402
from serve.lora import LoRAModule  # noqa: E402

# A served engine compiles every bucket first: few buckets (two sequences, 16-token steps).
ENGINE = {**ONE_SHOT_ENGINE, "enable_lora": True, "max_loras": 2, "max_lora_rank": 8, "max_num_seqs": 2,
          "max_num_batched_tokens": 16}
PROMPT = [17, 230, 4000, 52, 981, 33]
N = 8
MESSAGES = [{"role": "user", "content": "Name a colour."}]
GREEDY = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True)


@pytest.fixture(scope="module")
def paths(tmp_path_factory, smollm_tokenizer_dir):
    return build_set(str(tmp_path_factory.mktemp("lora_serve")), smollm_tokenizer_dir)


@pytest.fixture(scope="module")
def engine(paths):
    eng = make_engine(paths["base"], **ENGINE)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def server(engine, paths):
    mp = pytest.MonkeyPatch()
    mp.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
    config = ServingConfig(port=0, served_model_names=("tiny",),
                           lora_modules=(LoRAModule("a4", paths["a4"]), LoRAModule("b8", paths["b8"])))
    try:
        srv = ServerThread(engine, config)
    finally:
        mp.undo()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def offline(paths):
    """name (None: the base) -> (prompt's token ids, chat answer text), from the offline LLM."""
    llm = LLM(paths["base"], **ENGINE)
    out = {}
    for i, name in enumerate((None, "a4", "b8", "c8")):
        lr = None if name is None else LoRARequest(name, i, paths[name])
        toks = llm.generate([{"prompt_token_ids": PROMPT}], GREEDY, lora_request=lr, use_tqdm=False)
        chat = llm.chat([MESSAGES], GREEDY, lora_request=lr, use_tqdm=False)
        out[name] = (list(toks[0].outputs[0].token_ids), chat[0].outputs[0].text)
    return out


def completion_ids(client, model: str) -> list[int]:
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=N, temperature=0, logprobs=0,
                                  extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    return [int(t.split(":")[1]) for t in r.choices[0].logprobs.tokens]


def chat_text(client, model: str) -> str:
    r = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=N, temperature=0,
                                       extra_body={"ignore_eos": True})
    return r.choices[0].message.content


def responses_text(client, model: str) -> str:
    r = client.responses.create(model=model, input=MESSAGES, max_output_tokens=N, temperature=0, store=False,
                                extra_body={"ignore_eos": True})
    return r.output_text


def test_model_selects_the_adapter_as_the_offline_lora_request(client, offline):
    for served, name in (("tiny", None), ("a4", "a4"), ("b8", "b8")):
        assert completion_ids(client, served) == offline[name][0], served
        assert chat_text(client, served) == offline[name][1], served
        assert responses_text(client, served) == offline[name][1], served   # /v1/responses too
    assert len({tuple(offline[n][0]) for n in (None, "a4", "b8")}) == 3   # each adapter changes the tokens


def test_models_lists_each_adapter_with_parent_and_root(client, paths):
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) == {"tiny", "a4", "b8"}
    for name in ("a4", "b8"):
        assert (cards[name].parent, cards[name].root) == ("tiny", paths[name])
    assert cards["tiny"].parent is None


def test_runtime_load_use_unload(client, http, paths, offline):
    before = cc.counts()
    r = http.post("/v1/load_lora_adapter", json={"lora_name": "c8", "lora_path": paths["c8"]})
    assert (r.status_code, r.text) == (200, "Success: LoRA adapter 'c8' added successfully."), r.text
    assert cc.counts() == before                                  # loading compiles nothing
    r = http.post("/v1/load_lora_adapter", json={"lora_name": "c8", "lora_path": paths["c8"]})
    assert_error_shape(r.json(), 400, "lora_name")
    assert "already been loaded" in r.json()["error"]["message"]
    assert completion_ids(client, "c8") == offline["c8"][0]
    assert "c8" in {m.id for m in client.models.list().data}

    before = cc.counts()
    r = http.post("/v1/unload_lora_adapter", json={"lora_name": "c8"})
    assert (r.status_code, r.text) == (200, "Success: LoRA adapter 'c8' removed successfully."), r.text
    assert cc.counts() == before                                  # nor does unloading
    with pytest.raises(openai.NotFoundError, match="The model `c8` does not exist."):
        completion_ids(client, "c8")
    r = http.post("/v1/unload_lora_adapter", json={"lora_name": "c8"})
    assert_error_shape(r.json(), 404, "lora_name")
    assert "c8" not in {m.id for m in client.models.list().data}
    r = http.post("/v1/load_lora_adapter", json={"lora_name": "c8"})
    assert_error_shape(r.json(), 400, "lora_path")


def lora_info(http) -> list:
    """The samples of ``jaxllm:lora_requests_info`` on ``/metrics``."""
    return families(http.get("/metrics").text)["jaxllm:lora_requests_info"].samples


def test_lora_requests_info_names_the_running_adapter(client, http):
    t0 = time.time()
    stream = client.completions.create(model="b8", prompt=PROMPT, max_tokens=200, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    try:
        next(iter(stream))                     # the first token is out: the request runs
        during = lora_info(http)
    finally:
        stream.close()                         # aborts it
    assert [s.labels for s in during] == [{"max_lora": "2", "running_lora_adapters": "b8",
                                           "waiting_lora_adapters": ""}]
    assert t0 <= during[0].value <= time.time()   # vLLM's value: when it was set
    deadline = time.time() + 30
    while (after := lora_info(http))[0].labels["running_lora_adapters"] and time.time() < deadline:
        time.sleep(0.05)
    assert [s.labels for s in after] == [{"max_lora": "2", "running_lora_adapters": "",
                                          "waiting_lora_adapters": ""}]


def test_bad_adapters_refused_by_name_while_a_request_completes(client, http, paths, offline, tmp_path):
    bad = {
        "missing": (str(tmp_path / "gone"), "no such folder"),
        "dora": (edit_config(paths["a4"], str(tmp_path / "dora"), use_dora=True), "use_dora"),
        "rank16": (edit_config(paths["a4"], str(tmp_path / "r16"), r=16), "above max_lora_rank=8"),
        "router": (edit_config(paths["a4"], str(tmp_path / "router"), target_modules=["q_proj", "router_proj"]),
                   "router_proj"),
    }
    done = {}
    worker = threading.Thread(target=lambda: done.update(ids=completion_ids(client, "b8")))
    worker.start()
    for name, (path, reason) in bad.items():
        r = http.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path})
        err = assert_error_shape(r.json(), 400, "lora_path")
        assert name in err["message"] and reason in err["message"], err
    worker.join(60)
    assert done.get("ids") == offline["b8"][0]
    assert {m.id for m in client.models.list().data} == {"tiny", "a4", "b8"}


def test_runtime_routes_are_404_without_the_environment_variable(engine, paths):
    srv = ServerThread(engine, ServingConfig(port=0, lora_modules=(LoRAModule("a4", paths["a4"]),)))
    try:
        r = httpx.post(srv.base + "/v1/load_lora_adapter", json={"lora_name": "b8", "lora_path": paths["b8"]})
        assert_error_shape(r.json(), 404)
    finally:
        srv.stop()


@pytest.mark.parametrize("flags, needle", [
    (["--enable-lora", "--max-lora-rank", "12"], "--max-lora-rank 12"),
    (["--enable-lora", "--max-loras", "0"], "--max-loras"),
    (["--enable-lora", "--max-loras", "2", "--max-cpu-loras", "1"], "--max-cpu-loras"),
    (["--enable-lora", "--lora-dtype", "int8"], "--lora-dtype 'int8'"),
    (["--lora-modules", "a=/x"], "--lora-modules needs --enable-lora"),
    (["--enable-lora", "--lora-modules", "nopath"], "--lora-modules 'nopath'"),
    (["--enable-lora", "--lora-modules", '{"name": "a"}'], "--lora-modules"),
])
def test_flag_errors_name_the_flag(flags, needle, capsys):
    assert main(["serve", "--port", "0", *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("jaxllm serve: error: ") and needle in err[0], err
