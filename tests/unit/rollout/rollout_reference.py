"""The reference the engine is checked against: the same model code run over the whole sequence, no KV cache."""
import torch


@torch.inference_mode()
def naive_logprobs_TV(model, ids: list[int]) -> torch.Tensor:
    """log_softmax of a full forward over ids without a cache: row t is the distribution of token t+1."""
    return torch.log_softmax(model(torch.tensor([ids])).float()[0], dim=-1)


def naive_greedy(model, prompt: list[int], max_tokens: int, stop_ids: set[int]) -> tuple[list[int], list[float]]:
    """Greedy decoding by re-running the whole sequence each step (no cache)."""
    ids, tokens, logprobs = list(prompt), [], []
    for _ in range(max_tokens):
        lp_V = naive_logprobs_TV(model, ids)[-1]
        token = int(lp_V.argmax())
        tokens.append(token)
        logprobs.append(float(lp_V[token]))
        ids.append(token)
        if token in stop_ids:
            break
    return tokens, logprobs
