"""Multi-turn episodes of an RFT job with an Environment evaluator (reset(row) -> observation, step(action) ->
(observation, reward, done)), and the trajectory the loop trains, single-turn samples included.

An episode per sample:
    obs0 = env.reset(row)                     context = the row's prompt + obs0 (rendered, below)
    turn t = 1..max_turns: the policy samples action t from the context (up to max_tokens, like a single-turn
    sample); obs_t, r_t, done = env.step(action t, decoded as a single-turn completion is); the episode ends on
    done or after max_turns actions; otherwise context += action t + obs_t (rendered).
    reward = sum_t r_t. An env error, timeout or non-numeric reward (reset or any step) ends the episode with reward
    0 and the error (the loop logs it with the row, as for a reward_fn); a failed reset still samples one action
    from the bare prompt, so the sample is trained like a reward_fn's error row.

Rendering: a `prompt` row: the prompt's tokens, then each observation tokenized alone and appended as is. A
`messages` row: obs0 as one more user message before the generation prompt, and each later observation as a user
turn in the model's chat template (the template's tokens after the assistant's end-of-turn token: the user turn and
the next generation prompt). An empty observation adds nothing.

The trajectory trained is prompt + action1 + obs1 + action2 + ... + action_n: the action tokens carry the rollout's
logprobs and per-token versions (mask 1), the observation tokens are context only (mask 0, advantage 0, logprob 0:
never used). A single-turn sample is the trajectory of one action.

Sampling (EpisodeRunner): the loop's rollout (rollout.py: submit / update / result) samples every turn; the runner has
the same interface and drives a batch's episodes in a thread of its own, batch after batch in order, turn by turn
(all active episodes of a batch are one rollout batch per turn, keyed batch * KEY_STRIDE + turn), so async mode keeps
sampling the next batches while the trainer trains. Each turn is sampled at the rollout's current version; a weight
update mid-turn is handled by the rollout as for single-turn samples. The episodes of a batch are interleaved in the
one sandbox, each an Environment instance of its own (keyed by batch and sample).
"""
from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from models.chat import encode_chat_prompt
from services.evaluators.sandbox import EvaluatorError, Sandbox, Score
from services.trainer.rl.rollout import BatchStats, Sample, SampleRequest

KEY_STRIDE = 64  # rollout batch keys per RFT batch: one per turn (max_turns <= 64, trainyard/methods/rft.py)


@dataclass
class Trajectory:
    """What the loop trains and records for one sample: completion = everything after the prompt (actions and the
    observations between them); mask[i] = 1 for an action token; logprobs[i] = the rollout's logprob of an action
    token (0.0 for observation tokens, never used); token_versions = the version of each action token, in order."""
    prompt: list[int]
    completion: list[int]
    mask: list[int]
    logprobs: list[float]
    token_versions: list[int]
    versions: list[int]
    router_ids: object
    text: str
    score: Score | None = None  # an episode's reward (or error); None: the reward_fn scores `text`
    turns: list[dict] | None = None  # an episode's steps, for the samples record
    observation: str = ""  # reset's observation
    version_ids: list[str] = field(default_factory=list)  # served by a deployment: the weight-sync version ids

    @classmethod
    def single(cls, prompt: list[int], sample: Sample, text: str) -> Trajectory:
        n = len(sample.tokens)
        return cls(list(prompt), sample.tokens, [1] * n, sample.logprobs, sample.token_versions, sample.versions,
                   sample.router_ids, text, version_ids=sample.version_ids)

    @property
    def actions(self) -> list[int]:
        """The positions of the action tokens in the completion."""
        return [i for i, m in enumerate(self.mask) if m]


def completion_text(tokenizer, sample: Sample) -> str:
    """A sampled completion as the evaluator sees it: decoded, without the final end-of-sequence token."""
    tokens = sample.tokens
    if sample.finish_reason == "stop" and tokens:
        tokens = tokens[:-1]
    return tokenizer.decode(tokens, skip_special_tokens=True)


class Renderer:
    """Observations as tokens (module docstring)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._chat_turn: tuple[list[int], list[int]] | None = None

    def initial(self, row: dict, prompt: list[int], observation: str) -> list[int]:
        if not observation:
            return list(prompt)
        if isinstance(row.get("messages"), list):
            return encode_chat_prompt(self.tokenizer, row["messages"] + [{"role": "user", "content": observation}])
        return list(prompt) + self.tokenizer.encode(observation, add_special_tokens=False)

    def observation(self, row: dict, observation: str) -> list[int]:
        if not observation:
            return []
        if not isinstance(row.get("messages"), list):
            return self.tokenizer.encode(observation, add_special_tokens=False)
        return self._user_turn(observation)

    def _user_turn(self, observation: str) -> list[int]:
        """The template's tokens after an assistant turn's end-of-turn token: the user turn holding observation and
        the next generation prompt."""
        tok = self.tokenizer
        head = [{"role": "user", "content": "q"}]
        convo = head + [{"role": "assistant", "content": "a"}, {"role": "user", "content": observation}]
        opened = encode_chat_prompt(tok, head)  # ... up to the assistant's generation prompt
        full = encode_chat_prompt(tok, convo)
        eos = tok.eos_token_id
        if full[:len(opened)] != opened or eos not in full[len(opened):]:
            raise ValueError("the chat template does not render an assistant turn ending in the end-of-sequence "
                             "token after its generation prompt, so observations cannot be placed after an action; "
                             "use prompt rows")
        cut = full.index(eos, len(opened)) + 1
        return full[cut:]


@dataclass
class _Episode:
    id: str
    row: dict
    request: SampleRequest
    prompt: list[int] = field(default_factory=list)
    context: list[int] = field(default_factory=list)
    parts: list[tuple[list[int], Sample | None]] = field(default_factory=list)  # (tokens, the action's sample)
    turns: list[dict] = field(default_factory=list)
    observation: str = ""
    reward: float = 0.0
    error: str = ""
    over: bool = False

    def trajectory(self, text: str) -> Trajectory:
        completion, mask, logprobs, versions, seen, ids = [], [], [], [], set(), {}
        last = None
        for tokens, sample in self.parts:
            completion += tokens
            mask += [1 if sample else 0] * len(tokens)
            logprobs += sample.logprobs if sample else [0.0] * len(tokens)
            if sample:
                versions += sample.token_versions
                seen.update(sample.versions)
                ids.update(dict.fromkeys(sample.version_ids))
                last = sample
        score = Score(None, self.error) if self.error else Score(self.reward)
        return Trajectory(self.prompt, completion, mask, logprobs, versions, sorted(seen), last.router_ids, text,
                          score, self.turns, self.observation, list(ids))


class EpisodeRunner:
    """The rollout's interface (submit / update / result) for episodes; result gives groups of Trajectory."""

    def __init__(self, rollout, env: Sandbox, tokenizer, *, max_turns: int, rows: list[dict],
                 prompts: list[list[int]]):
        assert 1 <= max_turns <= KEY_STRIDE, max_turns
        self.rollout, self.env, self.tokenizer, self.max_turns = rollout, env, tokenizer, max_turns
        self.rows, self.prompts = rows, prompts
        self.renderer = Renderer(tokenizer)
        self._send = threading.Lock()  # the rollout's connection: this thread submits, the loop's updates
        self._inbox: queue.Queue = queue.Queue()
        self._done: dict[int, tuple[list[list[Trajectory]], BatchStats]] = {}
        self._cv = threading.Condition()
        self._error: BaseException | None = None
        self._stopping = False
        self._thread = threading.Thread(target=self._serve, name="rft-episodes", daemon=True)
        self._thread.start()

    def submit(self, batch: int, row_groups: list[list[tuple[int, int]]]) -> None:
        """Queue a batch: per prompt group, its samples' (dataset row index, seed)."""
        self._inbox.put((batch, row_groups))

    def update(self, version: int, weights: Path) -> None:
        with self._send:
            self.rollout.update(version, weights)

    def result(self, batch: int) -> tuple[list[list[Trajectory]], BatchStats]:
        with self._cv:
            while batch not in self._done and self._error is None:
                self._cv.wait()
            if batch in self._done:
                return self._done.pop(batch)
            raise self._error

    def close(self) -> None:
        """Stop after the current call; the caller closes the rollout next, which ends a turn being waited on."""
        self._stopping = True
        self._inbox.put(None)

    def join(self) -> None:
        self._thread.join()

    # -- the thread ---------------------------------------------------------------------------------------------
    def _serve(self) -> None:
        try:
            while (item := self._inbox.get()) is not None:
                out = self._batch(*item)
                if out is None:
                    return
                with self._cv:
                    self._done[item[0]] = out
                    self._cv.notify_all()
        except BaseException as exc:  # noqa: BLE001 - the loop raises it from result (RolloutLost: a retry)
            with self._cv:
                self._error = exc
                self._cv.notify_all()

    def _batch(self, batch: int, row_groups: list[list[tuple[int, int]]]):
        start = time.perf_counter()
        episodes = [[_Episode(f"{batch}.{g}.{s}", self.rows[r], SampleRequest(self.prompts[r], seed))
                     for s, (r, seed) in enumerate(group)] for g, group in enumerate(row_groups)]
        flat = [ep for group in episodes for ep in group]
        stats = BatchStats(0, 0, 0.0)
        for first in range(0, len(flat), self.env.max_episodes):  # at most the sandbox's cap open at once
            stats = self._episodes(batch, flat[first:first + self.env.max_episodes], stats)
        if self._stopping:
            return None
        text = {id(ep): self.tokenizer.decode(ep.context[len(ep.prompt):], skip_special_tokens=True) for ep in flat}
        return ([[ep.trajectory(text[id(ep)]) for ep in group] for group in episodes],
                BatchStats(stats.tokens, stats.discarded_tokens, time.perf_counter() - start))

    def _episodes(self, batch: int, episodes: list[_Episode], stats: BatchStats) -> BatchStats:
        """Run episodes to their ends, turn by turn; stats plus the tokens sampled."""
        tokens, discarded = stats.tokens, stats.discarded_tokens
        for ep in episodes:
            try:
                ep.observation = self.env.reset(ep.row, episode=ep.id)
            except EvaluatorError as exc:
                ep.error = str(exc)
            ep.prompt = self.renderer.initial(ep.row, ep.request.prompt, ep.observation)
            ep.context = list(ep.prompt)
        for turn in range(self.max_turns):
            active = [ep for ep in episodes if not ep.over]
            if not active or self._stopping:
                break
            key = batch * KEY_STRIDE + turn  # submitted and taken back before the next: unique while in flight
            with self._send:
                self.rollout.submit(key, [[SampleRequest(ep.context, ep.request.seed + 1_000_003 * turn)]
                                          for ep in active])
            groups, turn_stats = self.rollout.result(key)
            tokens, discarded = tokens + turn_stats.tokens, discarded + turn_stats.discarded_tokens
            for ep, (sample,) in zip(active, groups):
                self._step(ep, sample, turn)
        return BatchStats(tokens, discarded, 0.0)

    def _step(self, ep: _Episode, sample: Sample, turn: int) -> None:
        ep.parts.append((sample.tokens, sample))
        ep.context += sample.tokens
        if ep.error:  # reset failed: the one action is scored 0
            ep.over = True
            return
        action = completion_text(self.tokenizer, sample)
        try:
            observation, reward, done = self.env.step(action, episode=ep.id)
        except EvaluatorError as exc:
            ep.error, ep.over = str(exc), True
            ep.turns.append({"action": action, "error": str(exc)})
            self._close(ep)
            return
        ep.reward += reward
        ep.turns.append({"action": action, "observation": observation, "reward": reward, "done": done})
        if done or turn + 1 == self.max_turns:
            ep.over = True
            if not done:
                self._close(ep)
            return
        obs = self.renderer.observation(ep.row, observation)
        ep.parts.append((obs, None))
        ep.context += obs

    def _close(self, ep: _Episode) -> None:
        try:
            self.env.close_episode(ep.id)
        except EvaluatorError:
            pass  # the worker was killed meanwhile: the instance went with it
