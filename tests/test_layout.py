"""The layout the services keep: no import cycles between service folders, the scheduler never reaching training
code, and its process (CreateJob's checks included) never loading torch."""
import ast
import subprocess
import sys
from pathlib import Path

from models.tiny import build_tiny_model

ROOT = Path(__file__).resolve().parents[1]
SERVICES = ROOT / "services"


def _service_imports() -> dict[str, set[str]]:
    """services/<folder> -> the other service folders its modules import (at any depth, lazily or not)."""
    graph: dict[str, set[str]] = {}
    for folder in sorted(p for p in SERVICES.iterdir() if p.is_dir() and not p.name.startswith("__")):
        deps = graph.setdefault(folder.name, set())
        for path in folder.rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                    [node.module or ""] if isinstance(node, ast.ImportFrom) else []
                for name in names:
                    parts = name.split(".")
                    if parts[0] == "services" and len(parts) > 1 and parts[1] != folder.name:
                        deps.add(parts[1])
    return graph


def test_no_import_cycles_between_service_folders():
    graph = _service_imports()
    print({k: sorted(v) for k, v in graph.items()})

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        return any(d == goal or (d not in seen and reaches(d, goal, seen | {d})) for d in graph.get(start, ()))

    cycles = [folder for folder in graph if reaches(folder, folder, {folder})]
    assert cycles == [], f"import cycles through {cycles}: {graph}"
    assert graph["scheduler"] <= {"common", "evaluators"}, graph["scheduler"]  # it never imports training
    # control flows down; the worker hosts rollout engines too (evaluation jobs sample in it)
    assert graph["worker"] <= {"common", "trainer", "evaluators", "rollout"}, graph["worker"]
    assert graph["rollout"] <= {"common", "weightsync"}, graph["rollout"]  # serving never imports training
    assert graph["evaluators"] <= {"common"}, graph["evaluators"]  # the sandbox: torch-free, under both
    assert "scheduler" not in graph["trainer"] and "worker" not in graph["trainer"]
    assert graph["gateway"] <= {"common"}, graph["gateway"]  # a client of the services through the SDK only
    assert graph["planner"] <= {"common"}, graph["planner"]  # the Training Agent is a client of the APIs


def test_the_scheduler_checks_a_job_without_torch(tmp_path):
    """Inspecting model directories and checking LoRA targets against an architecture (CreateJob's checks) read
    config.json alone: the scheduler's modules and those checks run with torch never imported."""
    dense = build_tiny_model(tmp_path / "dense", family="qwen3")
    moe = build_tiny_model(tmp_path / "moe", family="deepseek_v3")
    script = f"""
import sys
import services.scheduler.app, services.scheduler.servicer, services.scheduler.jobs, services.worker.app
from models import inspect_model_dir
from services.common.methods.sft import lora_target_problem
assert inspect_model_dir({str(moe)!r}).architecture == "DeepseekV3ForCausalLM"
assert lora_target_problem({str(moe)!r}, ("q_a_proj", "experts")) is None
assert "Unknown LoRA target_modules ['q_proj']" in lora_target_problem({str(moe)!r}, ("q_proj",))
assert "tie_word_embeddings" in lora_target_problem({str(dense)!r}, ("lm_head",))
assert "torch" not in sys.modules, sorted(m for m in sys.modules if m.startswith("torch"))
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


def test_the_method_declarations_are_client_code():
    """trainyard/methods/ (each job method's settings, declared once) is read by the SDK, the CLI and the dashboard as
    well as the server: importing it, the client and the CLI loads neither torch nor the server's packages."""
    script = """
import sys
import trainyard.methods, trainyard.methods.proto, trainyard.client, trainyard.cli.main
loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "services", "models", "kernels"))
assert loaded == [], loaded
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]
