"""A tiny "scripted" checkpoint whose output the test chooses: for tool-calling and reasoning tests.

The SmolLM2 tokenizer gets extra (non-special) tokens, each a piece of a script such as
``<tool_call>\\n`` or ``{"name": "get_weather", ``.  The Llama's attention and MLP outputs are
zero, so the last layer sees only the current token's embedding; script tokens embed as
distinct basis vectors and the LM head maps each to its successor with a large logit, so
greedy decoding follows a script to its end (EOS).  After any ordinary token every logit is
0, so a request picks the script it wants with ``logit_bias`` on the script's first token
(+100 never outweighs a successor's logit, about 800).  The chat template prints
``reasoning_effort`` when it is given (for the tests of that template variable).
"""

from __future__ import annotations

import os

import numpy as np

EOS = "<|im_end|>"

SCRIPTS = {
    # Content, then two hermes tool calls (the argument JSON arrives in several tokens).
    "tools": ["Let me check.", "\n<tool_call>\n", '{"name": "get_weather", ', '"arguments": {"city": ', '"Paris"}}',
              "\n</tool_call>", '\n<tool_call>\n{"name": "get_time", "arguments": ', '{"tz": "CET"}}\n</tool_call>',
              EOS],
    # <think> reasoning, then content.
    "think": ["<think>", "I know", " this.", "</think>", "It is", " sunny.", EOS],
}

CHAT_TEMPLATE = """\
{%- if reasoning_effort is defined %}<|im_start|>system
Reasoning effort: {{ reasoning_effort }}<|im_end|>
{% endif %}
{%- if tools %}<|im_start|>system
You may call these tools:
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "assistant" and message.tool_calls %}<|im_start|>assistant
{%- for tc in message.tool_calls %}
<tool_call>
{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == "tool" %}<|im_start|>user
<tool_response id="{{ message.tool_call_id }}">
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def build_scripted(out_dir: str, tokenizer_dir: str) -> str:
    """Writes the scripted checkpoint (config, safetensors, tokenizer with the script tokens)."""
    import torch
    import transformers
    from tokenizers import AddedToken

    tok = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    pieces = [p for script in SCRIPTS.values() for p in script if p != EOS]
    assert len(set(pieces)) == len(pieces), "a script token may have only one successor"
    tok.add_tokens([AddedToken(p, special=False, normalized=False) for p in pieces])
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(out_dir)
    ids = {p: tok.convert_tokens_to_ids(p) for p in pieces}
    ids[EOS] = tok.convert_tokens_to_ids(EOS)
    hidden = 64
    cfg = transformers.LlamaConfig(
        vocab_size=len(tok), hidden_size=hidden, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6, bos_token_id=1,
        eos_token_id=ids[EOS], tie_word_embeddings=False)
    cfg.architectures = ["LlamaForCausalLM"]
    model = transformers.LlamaForCausalLM(cfg)
    rng = np.random.default_rng(0)
    n_script = len(pieces)
    assert n_script <= hidden // 2
    emb = np.zeros((len(tok), hidden), np.float32)
    # Ordinary tokens live in the upper half of the space, orthogonal to every script direction.
    emb[:, hidden // 2:] = rng.standard_normal((len(tok), hidden - hidden // 2))
    head = np.zeros((len(tok), hidden), np.float32)
    for k, p in enumerate(pieces):
        emb[ids[p]] = 0.0
        emb[ids[p], k] = 1.0
    for script in SCRIPTS.values():
        for cur, nxt in zip(script, script[1:]):
            head[ids[nxt], pieces.index(cur)] += 100.0
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            elif name.endswith(("o_proj.weight", "down_proj.weight")):
                p.zero_()
            else:
                p.copy_(torch.randn_like(p) * 0.1)
        model.model.embed_tokens.weight.copy_(torch.from_numpy(emb))
        model.lm_head.weight.copy_(torch.from_numpy(head))
    model.save_pretrained(out_dir, safe_serialization=True)
    with open(os.path.join(out_dir, "script_ids.json"), "w") as f:
        import json
        json.dump({name: [ids[p] for p in script] for name, script in SCRIPTS.items()}, f)
    return out_dir


def script_ids(path: str) -> dict[str, list[int]]:
    import json
    with open(os.path.join(path, "script_ids.json")) as f:
        return json.load(f)
