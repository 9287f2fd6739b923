"""Fake vllm.sampling_params (bench/e2e harness test)."""

import enum


class RequestOutputKind(enum.Enum):
    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


class SamplingParams:
    def __init__(self, temperature=1.0, max_tokens=16, ignore_eos=False, detokenize=True, logprobs=None,
                 output_kind=RequestOutputKind.CUMULATIVE):
        self.temperature, self.max_tokens, self.ignore_eos = temperature, max_tokens, ignore_eos
        self.detokenize, self.logprobs, self.output_kind = detokenize, logprobs, output_kind
