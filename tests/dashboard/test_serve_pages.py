"""The Deployments, Export and Playground pages through Streamlit's AppTest against the real stack (tests/conftest.py
`stack`), and the endpoint snippets they show: built here, then run as they are (curl) against the rollout's OpenAI
endpoint."""
from __future__ import annotations

import ast
import io
import json
import os
import shlex
import subprocess
import zipfile

import pytest
from streamlit.testing.v1 import AppTest

from dashboard import logic_serve
from dashboard.logic_serve import Conversation, Turn
from tests.dashboard.apptest import button, open_app, text
from tests.conftest import create_account
from tests.integration.data import chat_rows, jsonl
from trainyard import TrainyardError
from trainyard.localstack import free_port
from trainyard.client import status_name
from trainyard.v1 import scheduler_pb2 as pb

ACCOUNT = "dashboard-serve"  # the account of tests/dashboard/conftest.py's key and sdk


# -- snippets and helpers, no services --------------------------------------------------------------------------------
def test_openai_url_is_the_setting_or_the_rollout_host_on_port_8000():
    assert logic_serve.openai_url("rollout:50053", {}) == "http://rollout:8000/v1"
    assert logic_serve.openai_url("127.0.0.1:50053", {}) == "http://127.0.0.1:8000/v1"
    env = {"TRAINYARD_OPENAI_URL": "https://llm.example.com/v1/"}
    assert logic_serve.openai_url("rollout:50053", env) == "https://llm.example.com/v1"
    assert logic_serve.openai_internal_url("rollout:50053", env) == "https://llm.example.com/v1"
    env["TRAINYARD_OPENAI_INTERNAL_URL"] = "http://rollout:8000/v1"
    assert logic_serve.openai_internal_url("rollout:50053", env) == "http://rollout:8000/v1"


def test_snippets_name_the_model_and_read_the_key_from_the_environment():
    model = "it's-mine"  # a quote in the name must not break either snippet
    python = logic_serve.openai_snippet("http://h:8000/v1", model)
    tree = ast.parse(python)
    call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "OpenAI")
    kwargs = {k.arg: k.value for k in call.keywords}
    assert ast.literal_eval(kwargs["base_url"]) == "http://h:8000/v1"
    assert ast.unparse(kwargs["api_key"]) == "os.environ['TRAINYARD_API_KEY']"
    create = next(n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "attr", "") == "create")
    assert ast.literal_eval(next(k.value for k in create.keywords if k.arg == "model")) == model

    argv = shlex.split(logic_serve.curl_snippet("http://h:8000/v1", model).replace("\\\n", " "))
    assert argv[:3] == ["curl", "-s", "http://h:8000/v1/chat/completions"]
    assert argv[argv.index("-H") + 1] == "Authorization: Bearer $TRAINYARD_API_KEY"  # expanded by the shell
    assert json.loads(argv[argv.index("-d") + 1])["model"] == model


def test_served_together_counts_live_adapter_deployments_per_base():
    ready, failed = pb.DEPLOYMENT_STATUS_READY, pb.DEPLOYMENT_STATUS_FAILED
    lora, full = pb.CHECKPOINT_KIND_LORA_ADAPTER, pb.CHECKPOINT_KIND_FULL
    checkpoints = [pb.Checkpoint(id=i, kind=k) for i, k in (("a", lora), ("b", lora), ("c", lora), ("f", full))]
    deps = [pb.Deployment(name="one", base_model="m", checkpoint_id="a", status=ready),
            pb.Deployment(name="two", base_model="m", checkpoint_id="b", status=ready),
            pb.Deployment(name="broken", base_model="m", checkpoint_id="c", status=failed),
            pb.Deployment(name="whole", base_model="m", checkpoint_id="f", status=ready),
            pb.Deployment(name="follows", base_model="m", lineage="sess_1", status=ready),
            pb.Deployment(name="other", base_model="n", checkpoint_id="c", status=ready)]
    assert logic_serve.served_together(deps, checkpoints) == {"m": ["one", "two"], "n": ["other"]}


def test_max_tokens_bound_is_the_context_less_the_longest_conversation():
    short, long = Conversation(), Conversation()
    assert logic_serve.max_tokens_bound(256, [short, long]) == 255
    long.turns.append(Turn("x", prompt_tokens=40, generated_tokens=60, finish_reason="length"))
    short.turns.append(Turn("y", prompt_tokens=40, generated_tokens=2, finish_reason="stop"))
    assert logic_serve.max_tokens_bound(256, [short, long]) == 256 - 100 - 1
    assert logic_serve.max_tokens_bound(64, [long]) == 1
    msgs = logic_serve.request_messages(Conversation([{"role": "user", "content": "a"},
                                                      {"role": "assistant", "content": "b"}]), "be brief", "c")
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user"] and msgs[-1]["content"] == "c"


# -- the pages against the stack ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def job(sdk):
    ds, _ = sdk.upload_dataset(jsonl(chat_rows(12)), name="addition")
    job = sdk.create_sft_job("tiny-qwen3", ds.id, "serve-run", max_steps=4, batch_size=2, checkpoint_every=2,
                             learning_rate=3e-3)
    job = sdk.wait_job(job.id, timeout_s=300)
    assert status_name(job.status) == "succeeded", job.error
    return job


@pytest.fixture(autouse=True)
def signed_in_env(request, monkeypatch):
    if "stack" not in request.fixturenames:
        return
    stack, key = request.getfixturevalue("stack"), request.getfixturevalue("key")
    monkeypatch.setenv("TRAINYARD_URL", stack.url("scheduler"))
    monkeypatch.setenv("TRAINYARD_ROLLOUT_URL", stack.url("rollout"))
    monkeypatch.setenv("TRAINYARD_API_KEY", key)
    monkeypatch.setenv("TRAINYARD_OPENAI_URL", f"http://{stack.address('rollout', 8000)}/v1")


def open_page(page: str) -> AppTest:
    return open_app(page, timeout_s=180)


def ok(at: AppTest) -> None:
    assert not at.exception, [e.value for e in at.exception]
    assert not at.error, text(at.error)


@pytest.mark.integration
def test_pages_of_a_new_account_say_what_to_do_first(stack, monkeypatch):
    monkeypatch.setenv("TRAINYARD_API_KEY", create_account(stack.env_for("scheduler"), "dashboard-serve-newcomer"))
    for page, message in {"pages_deployments.py": "No deployments yet", "pages_export.py": "No checkpoints yet",
                          "pages_playground.py": "No deployments yet"}.items():
        at = open_page(page)
        assert message in text(at.info), page
        assert not [b for b in at.button if b.label == "Deploy" and not b.disabled], "nothing to deploy yet"


@pytest.mark.integration
def test_deployments_page_deploys_lists_snippets_tries_repoints_and_deletes(stack, sdk, key, job):
    ckpts = sdk.list_checkpoints(job.id)
    final = next(c for c in ckpts if c.final)
    early = next(c for c in ckpts if c.step == 2)
    at = open_page("pages_deployments.py")
    assert at.title[0].value == "Deployments" and "No deployments yet" in text(at.info)

    next(s for s in at.selectbox if s.label == "Job").set_value(job.id)
    next(t for t in at.text_input if t.label == "Deployment name").set_value("tuned").run()
    button(at, "Deploy").click().run()
    ok(at)
    assert "Deployment tuned is ready" in text(at.success)
    next(r for r in at.radio if r.label == "Deploy from").set_value("A checkpoint").run()
    next(s for s in at.selectbox if s.label == "Checkpoint").set_value(early.id)
    next(t for t in at.text_input if t.label == "Deployment name").set_value("bad name!").run()
    button(at, "Deploy").click().run()
    assert "INVALID_ARGUMENT" in text(at.error) and list(at.table[0].value["setting"]) == ["Deployment name"]
    next(t for t in at.text_input if t.label == "Deployment name").set_value("early").run()
    button(at, "Deploy").click().run()
    ok(at)

    listed = at.dataframe[0].value
    assert dict(zip(listed["name"], listed["serves"])) == {"tuned": final.id, "early": early.id}
    assert set(listed["status"]) == {"ready"}
    assert "tiny-qwen3 serves 2 LoRA adapters at once" in text(at.markdown)

    deps = {d.name: d for d in sdk.list_deployments()}
    public = f"http://{stack.address('rollout', 8000)}/v1"
    snippets = [c.value.strip() for c in at.code]
    assert logic_serve.openai_snippet(public, "tuned").strip() in snippets
    curl = logic_serve.curl_snippet(public, "tuned")
    assert curl.strip() in snippets and key not in "".join(snippets), "the key is never inlined"
    # The curl snippet, run as a user would (the key in the environment), answers like the SDK.
    ran = subprocess.run(["bash", "-c", curl], env={**os.environ, "TRAINYARD_API_KEY": key}, capture_output=True,
                         text=True, timeout=120)
    body = json.loads(ran.stdout)
    assert body["model"] == "tuned" and body["choices"][0]["message"]["role"] == "assistant", ran.stdout

    tuned = deps["tuned"]
    at.text_input(key=f"try-msg-{tuned.id}").set_value("What is 2 plus 2?")
    button(at, "", key=f"try-{tuned.id}").click().run()
    ok(at)
    expected = sdk.sample("tuned", messages=[{"role": "user", "content": "What is 2 plus 2?"}], temperature=0.0,
                          max_tokens=64).sequences[0].text
    assert "The endpoint answered:" in text(at.markdown)
    assert (expected or "(empty answer)") in [c.value for c in at.code]

    early_dep = deps["early"]
    at.selectbox(key=f"repoint-to-{early_dep.id}").set_value(final.id)
    button(at, "", key=f"repoint-{early_dep.id}").click().run()
    ok(at)
    assert sdk.get_deployment("early").checkpoint_id == final.id
    button(at, "", key=f"delete-{early_dep.id}").click().run()
    ok(at)
    assert [d.name for d in sdk.list_deployments()] == ["tuned"]
    assert list(at.dataframe[0].value["name"]) == ["tuned"]


@pytest.mark.integration
def test_export_page_zips_the_adapter_and_the_merged_model(sdk, job, tmp_path):
    final = next(c for c in sdk.list_checkpoints(job.id) if c.final)
    at = open_page("pages_export.py")
    assert at.title[0].value == "Export"
    assert next(s for s in at.selectbox if s.label == "Checkpoint").value == final.id
    button(at, "", key="prepare-adapter").click().run()
    ok(at)
    adapter = zipfile.ZipFile(io.BytesIO(at.session_state["export_ready"][(final.id, "adapter")]))
    sdk.download_checkpoint(final.id, tmp_path / "adapter")
    assert sorted(adapter.namelist()) == sorted(f.path for f in final.files)
    assert all(adapter.read(f.path) == (tmp_path / "adapter" / f.path).read_bytes() for f in final.files)

    button(at, "", key="prepare-merged").click().run()
    ok(at)
    merged = zipfile.ZipFile(io.BytesIO(at.session_state["export_ready"][(final.id, "merged")]))
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(merged.namelist())
    assert list(at.session_state["export_ready"]) == [(final.id, "merged")], "one archive held at a time"
    sdk.export_merged_model(final.id, tmp_path / "merged")
    assert merged.read("model.safetensors") == (tmp_path / "merged" / "model.safetensors").read_bytes()


@pytest.mark.integration
def test_playground_keeps_a_conversation_per_column_with_a_bounded_max_tokens(sdk, job):
    early = next(c for c in sdk.list_checkpoints(job.id) if c.step == 2)
    if "tuned" not in [d.name for d in sdk.list_deployments()]:
        sdk.create_deployment("tuned", job_id=job.id)
    at = open_page("pages_playground.py")
    context = sdk.get_model("tiny-qwen3").max_position_embeddings
    max_tokens = next(n for n in at.number_input if n.label == "Max tokens")
    assert max_tokens.max == context - 1

    next(s for s in at.selectbox if s.label == "Compare with a checkpoint").set_value(early.id).run()
    button(at, f"Deploy {early.id}").click().run()
    ok(at)
    assert f"Checkpoint · step 2 · playground-{early.id}" in text(at.markdown)
    next(s for s in at.slider if s.label == "Temperature").set_value(0.0)
    next(n for n in at.number_input if n.label == "Max tokens").set_value(6)
    models = ["tiny-qwen3", "tuned", f"playground-{early.id}"]
    history = {m: [] for m in models}
    for message in ("What is 3 plus 3?", "And 4 plus 4?"):
        at.text_area[0].set_value(message)
        button(at, "Send to all").click().run()
        ok(at)
        used = 0
        for m in models:  # each column's own answers are its history
            history[m].append({"role": "user", "content": message})
            reply = sdk.sample(m, messages=history[m], temperature=0.0, top_p=1.0, max_tokens=6, seed=0)
            history[m].append({"role": "assistant", "content": reply.sequences[0].text})
            used = max(used, len(reply.prompt_tokens) + len(reply.sequences[0].tokens))
        columns = [[t["content"] for t in history[m][1::2] if t["content"]] for m in models]
        assert [c.value for c in at.code] == [t for col in columns for t in col], "side by side, in order"
        assert next(n for n in at.number_input if n.label == "Max tokens").max == context - used - 1

    next(n for n in at.number_input if n.label == "Max tokens").set_value(context - used - 1)
    at.text_area[0].set_value(" ".join(["many more words"] * 20))
    button(at, "Send to all").click().run()
    assert not at.exception
    max_tokens_column = next(c for c in at.columns if any(n.label == "Max tokens" for n in c.number_input))
    errors = [e.value for e in max_tokens_column.error]
    assert len(errors) == 3 and all("does not fit: the model's context is" in e for e in errors), errors
    assert len(at.error) == 3, "each said once, under Max tokens"

    button(at, "Reset conversations").click().run()
    ok(at)
    assert not at.code and next(n for n in at.number_input if n.label == "Max tokens").max == context - 1
    assert sdk.get_deployment(f"playground-{early.id}").status == pb.DEPLOYMENT_STATUS_READY


@pytest.mark.integration
def test_try_endpoint_errors_read_like_the_sdks(stack, key):
    url = f"http://{stack.address('rollout', 8000)}/v1"
    cases = [(url, key, "no-such-model", "NOT_FOUND", "model"), (url, "ty_wrong", "tiny-qwen3", "UNAUTHENTICATED", ""),
             (f"http://127.0.0.1:{free_port()}/v1", key, "tiny-qwen3", "UNAVAILABLE", "cannot reach")]
    for base_url, api_key, model, code, words in cases:
        with pytest.raises(TrainyardError) as err:
            logic_serve.try_endpoint(base_url, api_key, model, "hi")
        assert err.value.code == code and words in err.value.message, err.value
    answer = logic_serve.try_endpoint(url, key, "tiny-qwen3", "hi", max_tokens=3)
    assert answer["model"] == "tiny-qwen3" and answer["usage"]["completion_tokens"] <= 3


@pytest.mark.integration
def test_local_stack_points_the_dashboards_openai_urls_at_the_rollout(stack):
    """docker-compose.yml gives people localhost:8000 and the dashboard rollout:8000; run as local processes, both
    are the rollout's own OpenAI port (trainyard/localstack.py maps published ports as it maps service names)."""
    env = stack.env_for("dashboard")
    local = f"http://{stack.address('rollout', 8000)}/v1"
    assert env["TRAINYARD_OPENAI_URL"] == local and env["TRAINYARD_OPENAI_INTERNAL_URL"] == local
