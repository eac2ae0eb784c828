"""Generation results, shaped like vLLM's: RequestOutput.outputs[i] is a CompletionOutput."""

import dataclasses
from typing import Dict, List, Optional, Union


@dataclasses.dataclass
class Logprob:
    """A token's log probability; rank is its 1-based place among the top alternatives (None
    when it is not among them); decoded_token is the token's text."""

    logprob: float
    rank: Optional[int] = None
    decoded_token: Optional[str] = None


# One position's alternatives: {token id: Logprob}, the sampled (or prompt) token included.
PositionLogprobs = Dict[int, Logprob]


@dataclasses.dataclass
class CompletionOutput:
    """One sequence of a request. In a stream (LLM.stream) text, token_ids and logprobs hold
    only what the event added; finish_reason is None until the sequence ends."""

    index: int
    text: str
    token_ids: List[int]
    cumulative_logprob: Optional[float]
    logprobs: Optional[List[PositionLogprobs]]
    finish_reason: Optional[str] = None  # "stop", "length", "abort"
    stop_reason: Union[None, int, str] = None  # the stop string or stop token id that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestOutput:
    """One request: its prompt, prompt token ids and, in outputs, its n sequences."""

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: List[int]
    prompt_logprobs: Optional[List[Optional[PositionLogprobs]]]
    outputs: List[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: Optional[Dict[str, float]] = None  # queue_time, first_token_time, time (seconds)
