"""tinker-cookbook's basic recipes (tinker_cookbook 0.6.1 from PyPI, unmodified) train on Trainyard: the unmodified
`tinker` 0.38 package they drive talks to the gateway, on a tiny model, for a few steps each.

- sl_basic: its main() on a train.Config made as its build_config_blueprint makes it, with the cookbook's own
  FromConversationFileBuilder (the swap-in its source shows) on a local chat JSONL in place of the NoRobots hub
  dataset; the supervised loss falls, the periodic and final checkpoints are saved, the final weights sample.
- sl_loop: its main() with its Config; `datasets.load_dataset("HuggingFaceH4/no_robots")` answers with the same
  local chat file (same "messages" column). The same checks.
- rl_basic: its main() on an rl train.Config made as its blueprint makes it, with the cookbook's own arithmetic
  environment (recipes/math_rl/arithmetic_env.py, problems generated locally) in place of GSM8K from the hub; the
  reward is logged every step, tokens are trained, the cookbook's sampler-vs-trainer KL is ~0, the final weights
  sample. Again on an environment of the tests' own (EvenTokensEnv, the cookbook's Env interface) whose dense reward
  gives non-zero advantages: the gradient is not zero.
- rl_loop: its main() with loss_fn="importance_sampling" (its default, stable_reinforce, needs Tinker's sampled
  provenance spans, which Trainyard does not record); `datasets.load_dataset("openai/gsm8k", "main")` answers with
  four local rows in GSM8K's format (tests/gateway/data/gsm8k_style.jsonl). The reward is logged (0: the tiny model
  writes no \\boxed{} answer, so the recipe skips its training steps) and the checkpoints are saved.

What differs from a run against Tinker, and why:
- The model: the built-in tiny Qwen3 model (its output layer tied to the input embeddings, as the small Qwen3
  models' are); the recipes create their LoRA with Tinker's default train_unembed=True, an adapter on that tied
  lm_head.
- Nothing is fetched from a hub: the recipes' datasets are local (above), the model's tokenizer is registered under
  its Trainyard name with the cookbook's register_tokenizer, and the cookbook's download of Tinker's price list
  (cost_estimation) is turned off (the recipes then log token counts without prices).
- The cookbook's model registry (model_info) knows only hub names and cannot be extended, so the loop recipes, which
  ask it for the renderer, get "qwen3" for the tiny model (its chat template is Qwen3's ChatML); the basic recipes
  take renderer_name in their config.
- The sizes are the tests': batch 4, a few steps, rank 8, short samples, a learning rate the tiny model learns from
  in a few steps.
"""
from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import chz
import datasets
import pytest
import tinker
from tinker_cookbook import checkpoint_utils, model_info, renderers, tokenizer_utils
from tinker_cookbook.recipes import rl_basic, rl_loop, sl_basic, sl_loop
from tinker_cookbook.recipes.math_rl.arithmetic_env import ArithmeticDatasetBuilder
from tinker_cookbook.rl import train as rl_train
from tinker_cookbook.rl.problem_env import ProblemGroupBuilder
from tinker_cookbook.rl.types import Env, RLDataset, RLDatasetBuilder, StepResult
from tinker_cookbook.supervised import train as sl_train
from tinker_cookbook.supervised.data import FromConversationFileBuilder
from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig
from tinker_cookbook.utils import cost_estimation

from trainyard import Client

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]
BASE = "tiny-qwen3"
RENDERER = "qwen3"
CHATS = ROOT / "examples" / "data" / "sft_demo.jsonl"
GSM8K_STYLE = Path(__file__).parent / "data" / "gsm8k_style.jsonl"


@pytest.fixture(scope="module")
def base_model_dir(stack, api_key) -> Path:
    """The shared tiny Qwen3 model's directory (for its tokenizer)."""
    with Client(url=stack.url("scheduler"), api_key=api_key) as c:
        return Path(c.get_model(BASE).path)


@pytest.fixture()
def gateway(stack, api_key, base_model_dir, monkeypatch) -> str:
    """The gateway's base_url, with the cookbook set up to reach Trainyard and nothing else: the account's key in
    the form the tinker SDK accepts, the model's tokenizer under its Trainyard name, no price-list download."""
    from transformers import AutoTokenizer

    monkeypatch.setenv("TINKER_API_KEY", "tml-" + api_key)
    tokenizer = AutoTokenizer.from_pretrained(base_model_dir)
    tokenizer_utils.register_tokenizer(BASE, lambda: tokenizer)
    monkeypatch.setattr(cost_estimation, "_pricing_fetched", True)
    monkeypatch.setattr(cost_estimation, "_pricing_entries", None)
    yield f"http://{stack.url('gateway')}"
    tokenizer_utils.unregister_tokenizer(BASE)


@pytest.fixture()
def loop_recipe_setup(monkeypatch):
    """For sl_loop and rl_loop: the renderer for the tiny model, and a hub dataset name answered by a local file."""
    recommended = model_info.get_recommended_renderer_name
    monkeypatch.setattr(model_info, "get_recommended_renderer_name",
                        lambda name: RENDERER if name == BASE else recommended(name))
    load_dataset = datasets.load_dataset

    def serve(hub_name: str, path: Path) -> None:
        def local(name: str, *args, **kwargs):
            if name != hub_name:
                return load_dataset(name, *args, **kwargs)
            rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
            return datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)})

        monkeypatch.setattr(datasets, "load_dataset", local)

    return serve


def metrics(log_path: Path) -> list[dict]:
    return [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines()]


def final_checkpoint(log_path: Path) -> checkpoint_utils.CheckpointRecord:
    records = checkpoint_utils.load_checkpoints_file(str(log_path))
    (final,) = [r for r in records if r.name == "final"]
    assert final.state_path and final.sampler_path, final
    return final


def samples_from(base_url: str, sampler_path: str) -> list[int]:
    """A few tokens sampled from saved weights through the gateway: the sampler checkpoint is real and loadable."""
    with tinker.ServiceClient(base_url=base_url) as service_client:
        sampling_client = service_client.create_sampling_client(model_path=sampler_path).result()
        response = sampling_client.sample(prompt=tinker.ModelInput.from_ints([5, 17, 33]), num_samples=1,
                                          sampling_params=tinker.SamplingParams(max_tokens=4, seed=0)).result()
    return response.sequences[0].tokens


def test_sl_basic(gateway, tmp_path):
    log_path = tmp_path / "sl_basic"
    common = ChatDatasetBuilderCommonConfig(model_name_for_tokenizer=BASE, renderer_name=RENDERER, max_length=256,
                                            batch_size=4, train_on_what=renderers.TrainOnWhat.ALL_ASSISTANT_MESSAGES)
    config = chz.Blueprint(sl_train.Config).apply({
        "log_path": str(log_path), "model_name": BASE, "recipe_name": "recipe_sl_basic", "renderer_name": RENDERER,
        "dataset_builder": FromConversationFileBuilder(common_config=common, file_path=str(CHATS)),
        "learning_rate": 3e-3, "lr_schedule": "linear", "num_epochs": 1, "eval_every": 8,
        "base_url": gateway, "lora_rank": 8, "save_every": 2,
    }).make()
    sl_basic.main(config)

    rows = [m for m in metrics(log_path) if "train_mean_nll" in m]
    assert len(rows) == 5  # 20 conversations, batches of 4
    assert rows[-1]["train_mean_nll"] < rows[0]["train_mean_nll"], [m["train_mean_nll"] for m in rows]
    records = checkpoint_utils.load_checkpoints_file(str(log_path))
    assert [r.name for r in records if r.name != "final"] == ["000002", "000004"]
    assert samples_from(gateway, final_checkpoint(log_path).sampler_path)


def test_sl_loop(gateway, loop_recipe_setup, tmp_path):
    loop_recipe_setup("HuggingFaceH4/no_robots", CHATS)
    log_path = tmp_path / "sl_loop"
    sl_loop.main(sl_loop.Config(base_url=gateway, log_path=str(log_path), model_name=BASE, batch_size=4,
                                learning_rate=3e-3, max_length=256, lora_rank=8, save_every=2, max_steps=4))

    rows = metrics(log_path)
    assert [m["step"] for m in rows] == [0, 1, 2, 3]
    assert rows[-1]["train_mean_nll"] < rows[0]["train_mean_nll"], [m["train_mean_nll"] for m in rows]
    resumable = checkpoint_utils.get_last_checkpoint(str(log_path))
    assert resumable.name == "final" and resumable.batch == 5
    assert samples_from(gateway, final_checkpoint(log_path).sampler_path)


class EvenTokensEnv(Env):
    """An environment of the tests' own, to the cookbook's Env interface: one turn, rewarded by the fraction of
    sampled tokens with an even id. The reward is dense, so the samples of a group differ, the advantages are not
    zero and every step moves the weights (the arithmetic environment's reward is the same for every sample of the
    tiny model, so its steps train on zero advantages)."""

    def __init__(self, renderer: renderers.Renderer, question: str):
        self.renderer, self.question = renderer, question

    async def initial_observation(self):
        prompt = self.renderer.build_generation_prompt([{"role": "user", "content": self.question}])
        return prompt, self.renderer.get_stop_sequences()

    async def step(self, action, *, extra=None) -> StepResult:
        return StepResult(reward=sum(t % 2 == 0 for t in action) / max(len(action), 1), episode_done=True,
                          next_observation=tinker.ModelInput.empty(),
                          next_stop_condition=self.renderer.get_stop_sequences())


class EvenTokensDataset(RLDataset):
    QUESTIONS = ("Name a color.", "What is the capital of France?", "List three fruits.", "Say hello.")

    def __init__(self, renderer: renderers.Renderer, batch_size: int, group_size: int, n_batches: int):
        self.renderer, self.batch_size, self.group_size, self.n_batches = renderer, batch_size, group_size, n_batches

    def get_batch(self, index: int) -> list[ProblemGroupBuilder]:
        questions = [self.QUESTIONS[(index * self.batch_size + i) % len(self.QUESTIONS)]
                     for i in range(self.batch_size)]
        return [ProblemGroupBuilder(env_thunk=partial(EvenTokensEnv, self.renderer, q), num_envs=self.group_size,
                                    dataset_name="even_tokens") for q in questions]

    def __len__(self) -> int:
        return self.n_batches


@chz.chz
class EvenTokensDatasetBuilder(RLDatasetBuilder):
    batch_size: int
    group_size: int
    n_batches: int

    async def __call__(self) -> tuple[EvenTokensDataset, None]:
        renderer = renderers.get_renderer(RENDERER, tokenizer=tokenizer_utils.get_tokenizer(BASE))
        return EvenTokensDataset(renderer, self.batch_size, self.group_size, self.n_batches), None


def run_rl_basic(gateway: str, log_path: Path, builder: RLDatasetBuilder) -> list[dict]:
    """rl_basic's main() on its blueprint's settings, with builder as the dataset; the metrics of its steps."""
    config = chz.Blueprint(rl_train.Config).apply({
        "model_name": BASE, "recipe_name": "recipe_rl_basic", "renderer_name": RENDERER, "log_path": str(log_path),
        "dataset_builder": builder, "learning_rate": 4e-5, "max_tokens": 8, "eval_every": 0,
        "base_url": gateway, "lora_rank": 8, "save_every": 1,
    }).make()
    rl_basic.main(config)

    steps = [m for m in metrics(log_path) if "env/all/reward/total" in m]
    assert len(steps) == 2, steps
    for m in steps:
        assert m["tokens/trained"] > 0, m
        # The cookbook's own check of the sampler against the trainer: the KL between the logprobs the rollout
        # returned with its samples and the trainer's logprobs of the same tokens (same weights) is ~0 (1e-4, the
        # tolerance of the trainer-vs-rollout logprob tests).
        assert abs(m["optim/kl_sample_train_v1"]) < 1e-4, m
    assert samples_from(gateway, final_checkpoint(log_path).sampler_path)
    return steps


def test_rl_basic(gateway, tmp_path):
    steps = run_rl_basic(gateway, tmp_path / "rl_basic", ArithmeticDatasetBuilder(
        batch_size=2, group_size=4, renderer_name=RENDERER, model_name_for_tokenizer=BASE, n_batches=2))
    assert all(-0.1 <= m["env/all/reward/total"] <= 1.0 for m in steps), steps


def test_rl_basic_on_a_dense_reward_trains(gateway, tmp_path):
    steps = run_rl_basic(gateway, tmp_path / "rl_basic_even",
                         EvenTokensDatasetBuilder(batch_size=2, group_size=4, n_batches=2))
    for m in steps:
        assert 0.0 < m["env/all/reward/total"] < 1.0 and m["env/all/by_group/frac_mixed"] > 0, m
        assert m["grad_norm"] > 0, m  # importance_sampling on non-zero advantages, through the gateway


def test_rl_loop(gateway, loop_recipe_setup, tmp_path):
    loop_recipe_setup("openai/gsm8k", GSM8K_STYLE)
    log_path = tmp_path / "rl_loop"
    rl_loop.main(rl_loop.Config(base_url=gateway, log_path=str(log_path), model_name=BASE, batch_size=2,
                                group_size=4, learning_rate=1e-3, lora_rank=8, save_every=1, max_tokens=8,
                                loss_fn="importance_sampling", max_steps=2))

    rows = metrics(log_path)
    assert [m["step"] for m in rows] == [0, 1]
    assert all(0.0 <= m["reward/total"] <= 1.0 for m in rows), rows
    records = checkpoint_utils.load_checkpoints_file(str(log_path))
    assert [r.name for r in records] == ["000001", "final"]
    assert samples_from(gateway, final_checkpoint(log_path).sampler_path)

