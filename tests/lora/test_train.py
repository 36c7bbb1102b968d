"""jaxllm/lora/train.py: a LoRA trained with optax through jaxllm.functional's forward lowers
its loss, is saved as peft saves adapters, loads in peft with the same logits (float32, 1e-4),
and the engine serves it with peft's greedy tokens.  One tiny random Llama, a few steps."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import peft
import pytest
import torch
import transformers

from support.engines import ONE_SHOT_ENGINE
from support.lora_adapters import hf_greedy

from jaxllm import LLM, LoRARequest, SamplingParams, functional
from jaxllm.lora.peft import read_config
from jaxllm.lora.train import init_lora, lora_logits, loss, save_peft

N = 6
PROMPT = np.random.default_rng(3).integers(3, 5000, size=7).tolist()


@pytest.fixture(scope="module")
def trained(tiny_llama, tmp_path_factory):
    """(params, forward, lora, losses, adapter folder): 8 adam steps on one sequence."""
    params, forward = functional.load(tiny_llama)
    lora = init_lora(forward.arch, rank=8, alpha=16, key=jax.random.key(0))
    tokens = jnp.asarray([np.random.default_rng(0).integers(3, 5000, size=12)], jnp.int32)   # [1, 12]
    mask = jnp.asarray([[0] * 6 + [1] * 6])                                                 # the answer: last 6
    opt = optax.adam(3e-2)
    state = opt.init(lora)

    @jax.jit
    def step(lora, state):
        value, grads = jax.value_and_grad(loss)(lora, params, forward, tokens, mask)
        updates, state = opt.update(grads, state, lora)
        return optax.apply_updates(lora, updates), state, value

    losses = []
    for _ in range(8):
        lora, state, value = step(lora, state)
        losses.append(float(value))
    path = save_peft(lora, str(tmp_path_factory.mktemp("lora_train") / "adapter"), tiny_llama)
    return params, forward, lora, losses, path


def test_optax_steps_lower_the_loss(trained):
    _, _, lora, losses, _ = trained
    assert losses[-1] < 0.7 * losses[0], losses
    # every projection of every layer was trained (B starts at zero): the forward reaches them all
    assert all(np.abs(ab["B"][i]).max() > 0 for ab in lora.weights.values() for i in range(ab["B"].shape[0]))


def test_saved_adapter_loads_in_peft_with_the_same_logits(trained, tiny_llama):
    params, forward, lora, _, path = trained
    cfg = read_config(path)
    assert (cfg["peft_type"], cfg["task_type"], cfg["r"], cfg["lora_alpha"]) == ("LORA", "CAUSAL_LM", 8, 16)
    base = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(base, path).eval()
    with torch.no_grad():
        want = model(torch.tensor([PROMPT])).logits.numpy()
    got = np.asarray(lora_logits(lora, params, forward, jnp.asarray([PROMPT])))
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    base_logits = np.asarray(forward(params, jnp.asarray([PROMPT])))
    assert np.abs(base_logits - want).max() > 1e-2        # the trained adapter changes the model


def test_engine_serves_the_trained_adapter_as_peft(trained, tiny_llama):
    *_, path = trained
    want = hf_greedy(tiny_llama, {"trained": path}, [PROMPT], N)[("trained", 0)]
    llm = LLM(tiny_llama, **{**ONE_SHOT_ENGINE, "skip_tokenizer_init": True, "enable_lora": True,
                            "max_lora_rank": 8})
    out = llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(temperature=0, max_tokens=N, ignore_eos=True),
                       lora_request=LoRARequest("trained", 1, path))
    assert out[0].outputs[0].token_ids == want
