"""The dashboard's Evaluators page through Streamlit's AppTest, against the real scheduler (alone: the page talks to
nothing else): upload with a field error then a good file, the list, and "Test on N rows" with per-row results."""
from __future__ import annotations

import json

import pytest
from streamlit.testing.v1 import AppTest

from dashboard import logic_evaluators
from tests.conftest import ROOT
from tests.services.evaluators.scheduler_only import scheduler_only
from trainyard import Client, TrainyardError

APP = str(ROOT / "dashboard" / "app.py")
REWARD = b'''\
def reward_fn(completion, row):
    print("scoring", completion)
    return float(completion.strip() == str(row["answer"]))
'''


@pytest.fixture(scope="module")
def accounts(tmp_path_factory, pg_url):
    with scheduler_only(tmp_path_factory.mktemp("scheduler"), pg_url, ("dashboard-evaluators", "dashboard-other"),
                        evaluator_wall_s=10) as (url, keys):
        yield url, keys


@pytest.fixture(scope="module")
def scheduler(accounts):
    url, keys = accounts
    return url, keys["dashboard-evaluators"]


@pytest.fixture(autouse=True)
def signed_in_env(monkeypatch, scheduler):
    url, key = scheduler
    monkeypatch.setenv("TRAINYARD_URL", url)
    monkeypatch.setenv("TRAINYARD_API_KEY", key)


def _text(elements) -> str:
    return "\n".join(str(e.value) for e in elements).replace("**", "").replace("\\", "")


def _button(at: AppTest, label: str):
    return next(b for b in at.button if b.label.startswith(label))


def test_parse_rows_names_bad_lines():
    rows, problems = logic_evaluators.parse_rows('{"a": 1}\n\n[1]\nnope\n{"b": 2}\n')
    assert rows == [{"a": 1}, {"b": 2}]
    assert [p.split(":")[0] for p in problems] == ["line 3", "line 4"]


def test_upload_list_and_test_on_rows(scheduler):
    url, key = scheduler
    at = AppTest.from_file(APP, default_timeout=60)
    at.run()
    at.switch_page("pages_evaluators.py").run()
    assert not at.exception, [e.value for e in at.exception]
    assert at.title[0].value == "Evaluators" and "No evaluators yet" in _text(at.main.info)

    name_box = next(t for t in at.text_input if t.label == "Name")
    at.file_uploader[0].set_value(("evaluator.py", b"def reward_fn(c, row)\n", "text/x-python"))
    name_box.set_value("exact").run()
    _button(at, "Check and upload").click().run()
    assert "The server rejected the request" in _text(at.error) and "SyntaxError" in _text(at.error)

    at.file_uploader[0].set_value(("evaluator.py", REWARD, "text/x-python")).run()
    _button(at, "Check and upload").click().run()
    assert not at.exception, [e.value for e in at.exception]
    assert "Stored exact@1 (reward_fn)" in _text(at.success)
    listed = at.dataframe[0].value
    assert list(listed["name"]) == ["exact"] and list(listed["version"]) == [1]

    next(r for r in at.radio if r.label == "Rows from").set_value("Rows I paste").run()
    rows = [{"answer": 4, "completion": "4"}, {"answer": 4, "completion": "5"}, {"completion": "4"}]
    next(t for t in at.text_area if t.label == "Rows (JSONL)").set_value("\n".join(map(json.dumps, rows))).run()
    _button(at, "Test on 3 rows").click().run()
    assert not at.exception, [e.value for e in at.exception]
    assert [m.value for m in at.metric][:2] == ["2/3", "1"]
    results = at.dataframe[-1].value
    assert list(results["completion"]) == ["4", "5", "4"]
    assert list(results["reward"])[:2] == [1.0, 0.0] and list(results["error"])[2] == "KeyError: 'answer' (line 3)"
    with Client(url=url, api_key=key) as sdk:  # what the page shows is what the server stored
        assert [(e.name, e.version) for e in sdk.list_evaluators()] == [("exact", 1)]
        rows = [{"prompt": f"{i}+{i}=", "completion": str(2 * i if i else 7), "answer": 2 * i} for i in range(5)]
        ds, _ = sdk.upload_dataset("".join(json.dumps(r) + "\n" for r in rows).encode(), name="sums")

    next(r for r in at.radio if r.label == "Rows from").set_value("A dataset").run()
    next(s for s in at.selectbox if s.label == "Dataset").set_value(ds.id)
    next(n for n in at.number_input if n.label == "Rows").set_value(3).run()
    _button(at, "Test on 3 rows").click().run()
    assert not at.exception, [e.value for e in at.exception]
    results = at.dataframe[-1].value
    assert list(results["completion"]) == ["7", "2", "4"] and list(results["reward"]) == [0.0, 1.0, 1.0]
    assert "scoring 7" in at.code[-1].value  # what the evaluator printed


def test_editor_tests_an_unsaved_change_on_five_rows_then_saves_a_version(scheduler):
    """The editor opens the stored source (GetEvaluatorSource), "Test on 5 rows" runs the edited text in the sandbox
    without storing it, and "Save as" stores it as the next version, which the editor then holds."""
    url, key = scheduler
    with Client(url=url, api_key=key) as sdk:
        sdk.upload_evaluator(REWARD, name="editable")
        rows = [{"prompt": f"{i}+1=", "completion": str(i + 1), "answer": i + 1} for i in range(7)]
        ds, _ = sdk.upload_dataset("".join(json.dumps(r) + "\n" for r in rows).encode(), name="plus-one")
    at = AppTest.from_file(APP, default_timeout=60)
    at.run()
    at.switch_page("pages_evaluators.py").run()
    editable = next(e for e in sdk_list(url, key) if e.name == "editable")
    next(s for s in at.selectbox if s.label == "Evaluator to edit").set_value(editable.id).run()
    editor = next(t for t in at.text_area if t.label == "Source (evaluator.py)")
    assert editor.value == REWARD.decode()

    editor.set_value(REWARD.decode().replace("return float(", "return 0.5 + 0.5 * float("))
    next(s for s in at.selectbox if s.label == "Dataset to test on").set_value(ds.id).run()
    _button(at, "Test on 5 rows").click().run()
    assert not at.exception, [e.value for e in at.exception]
    results = at.dataframe[1].value  # the list of evaluators, then the edited source's results
    assert list(results["row"]) == [1, 2, 3, 4, 5] and list(results["reward"]) == [1.0] * 5
    assert [(e.name, e.version) for e in sdk_list(url, key) if e.name == "editable"] == [("editable", 1)], \
        "a test stores nothing"

    next(t for t in at.text_area if t.label == "Source (evaluator.py)").set_value("def reward_fn(c, row)\n").run()
    _button(at, "Test on 5 rows").click().run()
    assert "INVALID_ARGUMENT" in _text(at.error) and "SyntaxError" in _text(at.error)
    assert list(at.table[0].value["field"]) == ["content"]

    edited = REWARD.decode().replace("return float(", "return 0.25 * float(")
    next(t for t in at.text_area if t.label == "Source (evaluator.py)").set_value(edited).run()
    _button(at, "Save as editable@2").click().run()
    assert not at.exception, [e.value for e in at.exception]
    assert "Saved editable@2 (reward_fn)" in _text(at.success)
    assert next(t for t in at.text_area if t.label == "Source (evaluator.py)").value == edited
    with Client(url=url, api_key=key) as sdk:
        assert sdk.get_evaluator_source("editable@2").content == edited.encode()
        assert sdk.get_evaluator_source("editable@1").content == REWARD


def test_unsaved_content_and_sources_are_the_callers_own(accounts):
    url, keys = accounts
    key = keys["dashboard-evaluators"]
    with Client(url=url, api_key=key) as sdk:
        with pytest.raises(TrainyardError) as err:
            sdk.test_evaluator("exact", rows=[{"completion": "1"}], content=REWARD)
        assert err.value.code == "INVALID_ARGUMENT" and err.value.violations[0].field == "content"
        resp = sdk.test_evaluator("", rows=[{"answer": 1, "completion": "1"}], content=REWARD)
        assert [r.reward for r in resp.results] == [1.0] and not resp.HasField("evaluator")
        mine = sdk.upload_evaluator(REWARD, name="private")
    with Client(url=url, api_key=keys["dashboard-other"]) as other, pytest.raises(TrainyardError) as err:
        other.get_evaluator_source(mine.id)
    assert err.value.code == "NOT_FOUND"


def sdk_list(url: str, key: str):
    with Client(url=url, api_key=key) as sdk:
        return sdk.list_evaluators()
