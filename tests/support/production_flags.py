"""The workload tests/runner/test_production_flags.py runs under the suite's XLA flags and,
in support/production_flags_probe.py, under XLA's defaults."""

from jaxllm import SamplingParams

PROMPTS = [[100, 200, 300, 400, 500, 600, 700, 800, 900, 1000, 1100, 1200]]


def run(llm, prompts) -> dict:
    """Greedy 8 tokens per prompt, with each token's logprob and every prompt token's."""
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0, prompt_logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return {"tokens": [o.outputs[0].token_ids for o in outs],
            "logprobs": [[lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]
                         for o in outs],
            "prompt_logprobs": [[lp[t].logprob for t, lp in zip(p[1:], o.prompt_logprobs[1:])]
                                for p, o in zip(prompts, outs)]}
