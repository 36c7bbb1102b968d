"""OutputProcessor: engine-core outputs -> ``RequestOutput``s users see.

Per request id it detokenizes incrementally, applies stop strings (which end a request
the core does not know has stopped: the ids to abort are handed back), gathers logprobs,
merges the n child sequences of a parent request, and shapes the output as cumulative,
delta (streaming) or final-only.  In delta mode, text that could be the start of a stop
string is held back until it is known not to be.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from jaxllm.engine.detokenizer import IncrementalDetokenizer, find_stop_string
from jaxllm.engine.processor import InvalidRequestError
from jaxllm.outputs import CompletionOutput, EngineCoreOutput, Logprob, LogprobsArrays, RequestOutput
from jaxllm.request import EngineRequest
from jaxllm.sampling_params import SamplingParams


class OutputKind(enum.Enum):
    CUMULATIVE = "cumulative"
    DELTA = "delta"
    FINAL_ONLY = "final"


@dataclass
class _Seq:
    index: int
    child_id: str
    detok: IncrementalDetokenizer | None
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    sent_tokens: int = 0
    sent_text: int = 0
    sent_finish: bool = False


@dataclass
class _ReqState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    kind: OutputKind
    seqs: list[_Seq]
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    """vLLM's shape: None for the first prompt token, then one dict per prompt token."""
    sent_prompt_logprobs: bool = False
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.seqs)


def child_request_id(request_id: str, index: int, n: int) -> str:
    return request_id if n == 1 else f"{index}_{request_id}"


class OutputProcessor:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._reqs: dict[str, _ReqState] = {}
        self._child_to_parent: dict[str, tuple[str, int]] = {}

    def add_request(self, request: EngineRequest, kind: OutputKind) -> list[str]:
        """Registers a request; returns the child ids the core runs for it.  A request id stays
        in use until its request has finished or been aborted (ValueError meanwhile)."""
        if request.request_id in self._reqs:
            raise InvalidRequestError(f"request id {request.request_id!r} is already in use")
        params = request.params
        seqs = []
        for i in range(params.n):
            cid = child_request_id(request.request_id, i, params.n)
            detok = None
            if self.tokenizer is not None and params.detokenize:
                detok = IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids, params.skip_special_tokens)
            seqs.append(_Seq(index=i, child_id=cid, detok=detok,
                             logprobs=[] if params.logprobs is not None else None,
                             cumulative_logprob=0.0 if params.logprobs is not None else None))
            self._child_to_parent[cid] = (request.request_id, i)
        self._reqs[request.request_id] = _ReqState(request.request_id, request.prompt, request.prompt_token_ids,
                                                   params, kind, seqs)
        return [s.child_id for s in seqs]

    def request_ids(self) -> list[str]:
        """The ids of the requests added and neither finished nor aborted yet."""
        return list(self._reqs)

    def child_ids(self, request_id: str) -> list[str]:
        st = self._reqs.get(request_id)
        return [s.child_id for s in st.seqs if s.finish_reason is None] if st else []

    def parent_id(self, child_id: str) -> str:
        """The id the request was added with (a child of an n > 1 request maps to its parent)."""
        parent = self._child_to_parent.get(child_id)
        return child_id if parent is None else parent[0]

    def process(self, outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[str], dict[str, int]]:
        """Returns the RequestOutputs to deliver, the child ids the core must abort, and the
        output tokens each request (parent id) gained."""
        touched: dict[str, _ReqState] = {}
        to_abort: list[str] = []
        new_tokens: dict[str, int] = {}
        for out in outputs:
            parent = self._child_to_parent.get(out.request_id)
            if parent is None:
                continue
            st = self._reqs[parent[0]]
            seq = st.seqs[parent[1]]
            if seq.finish_reason is not None:
                continue
            before = len(seq.token_ids)
            self._append(st, seq, out)
            new_tokens[st.request_id] = new_tokens.get(st.request_id, 0) + len(seq.token_ids) - before
            if seq.finish_reason is not None and out.finish_reason is None:
                to_abort.append(seq.child_id)  # a stop string: the core still thinks it runs
            touched[st.request_id] = st
        results = []
        for st in touched.values():
            ro = self._make_output(st)
            if ro is not None:
                results.append(ro)
            if st.finished:
                self._drop(st)
        return results, to_abort, new_tokens

    def _entries(self, lps: LogprobsArrays) -> list[dict[int, Logprob]]:
        """Each position's logprobs as user-facing objects: the chosen token (its own rank)
        first, then the top ones."""
        out = []
        for ids, values, rank0 in zip(lps.token_ids.tolist(), lps.logprobs.tolist(), lps.ranks.tolist()):
            entry: dict[int, Logprob] = {}
            for rank_i, (tid, lpv) in enumerate(zip(ids, values)):
                if tid not in entry:
                    entry[tid] = Logprob(lpv, rank0 if rank_i == 0 else rank_i, self._decode_one(tid))
            out.append(entry)
        return out

    def _append(self, st: _ReqState, seq: _Seq, out: EngineCoreOutput) -> None:
        p = st.params
        st.num_cached_tokens = max(st.num_cached_tokens, out.num_cached_tokens)
        if out.prompt_logprobs is not None and st.prompt_logprobs is None:
            st.prompt_logprobs = [None] + self._entries(out.prompt_logprobs)
        new_lps = (self._entries(out.new_logprobs) if seq.logprobs is not None and out.new_logprobs is not None
                   else [])
        for j, tok in enumerate(out.new_token_ids):
            seq.token_ids.append(tok)
            if j < len(new_lps):
                seq.logprobs.append(new_lps[j])
                seq.cumulative_logprob += float(out.new_logprobs.logprobs[j, 0])
            if seq.detok is not None:
                # vLLM leaves a stop token's text out unless include_stop_str_in_output.
                is_stop_tok = out.finish_reason == "stop" and j == len(out.new_token_ids) - 1
                piece = seq.detok.add(tok)
                if is_stop_tok and not p.include_stop_str_in_output:
                    piece = ""
                seq.text += piece
                hit = find_stop_string(seq.text, len(piece), p.stop, p.include_stop_str_in_output)
                if hit is not None:
                    seq.text = seq.text[:hit[1]]
                    seq.finish_reason, seq.stop_reason = "stop", hit[0]
                    # Tokens after the one that completed the stop string are dropped.
                    return
        if out.finish_reason is not None:
            seq.finish_reason, seq.stop_reason = out.finish_reason, out.stop_reason

    def _decode_one(self, tid: int) -> str | None:
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode([tid])

    def _make_output(self, st: _ReqState) -> RequestOutput | None:
        if st.kind == OutputKind.FINAL_ONLY and not st.finished:
            return None
        comps = []
        holdback = 0
        if st.params.stop and not st.params.include_stop_str_in_output:
            holdback = max(len(s) for s in st.params.stop) - 1
        for seq in st.seqs:
            if st.kind != OutputKind.DELTA:
                comps.append(CompletionOutput(seq.index, seq.text, list(seq.token_ids), seq.cumulative_logprob,
                                              list(seq.logprobs) if seq.logprobs is not None else None,
                                              seq.finish_reason, seq.stop_reason))
                continue
            done = seq.finish_reason is not None
            text_end = len(seq.text) if done else max(seq.sent_text, len(seq.text) - holdback)
            new_text = seq.text[seq.sent_text:text_end]
            new_tokens = seq.token_ids[seq.sent_tokens:]
            if not new_tokens and not new_text and (not done or seq.sent_finish):
                continue
            comps.append(CompletionOutput(
                seq.index, new_text, new_tokens, seq.cumulative_logprob,
                seq.logprobs[seq.sent_tokens:] if seq.logprobs is not None else None,
                seq.finish_reason, seq.stop_reason))
            seq.sent_text, seq.sent_tokens = text_end, len(seq.token_ids)
            seq.sent_finish = done
        if not comps:
            return None
        prompt_lps = st.prompt_logprobs
        if st.kind == OutputKind.DELTA:
            # Streaming sends them once, with the first output (as vLLM does).
            prompt_lps = None if st.sent_prompt_logprobs else prompt_lps
            st.sent_prompt_logprobs = st.sent_prompt_logprobs or prompt_lps is not None
        return RequestOutput(st.request_id, st.prompt, st.prompt_token_ids, prompt_lps, comps, st.finished,
                             num_cached_tokens=st.num_cached_tokens)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Ends a request from outside (client gone, user abort); returns its final output."""
        st = self._reqs.get(request_id)
        if st is None:
            return None
        for seq in st.seqs:
            if seq.finish_reason is None:
                seq.finish_reason = "abort"
        ro = self._make_output(st)
        self._drop(st)
        return ro

    def _drop(self, st: _ReqState) -> None:
        self._reqs.pop(st.request_id, None)
        for seq in st.seqs:
            self._child_to_parent.pop(seq.child_id, None)
