"""Fake vllm.inputs (bench/e2e harness test): TokensPrompt is a dict, as in vLLM."""


def TokensPrompt(prompt_token_ids):  # noqa: N802 - vLLM's name
    return {"prompt_token_ids": list(prompt_token_ids)}
