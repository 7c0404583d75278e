"""A chat-template worker process (started by services/rollout/templates.py; python -m
services.rollout.template_worker CPU_S MEMORY_MB): renders one template at a time, as transformers'
apply_chat_template(tokenize=False) does, under limits of its own.

- Memory: the address space is capped at what the process holds after its imports plus MEMORY_MB, so an allocation
  beyond it raises MemoryError in the render.
- CPU: before each render the soft RLIMIT_CPU is set CPU_S (rounded up to whole seconds) past the CPU time used so
  far; the kernel's SIGXCPU then raises OverCpu (a BaseException, which no template or library code catches) in the
  render. The parent kills a worker that keeps running anyway.

Protocol: one JSON object per line each way. In: {"template", "messages", "add_generation_prompt", "variables"}.
Out: {"text"} or {"error": "cpu" | "memory" | "template", "message"}.
"""
from __future__ import annotations

import json
import math
import resource
import signal
import sys


class OverCpu(BaseException):
    pass


def _over_cpu(signum, frame):
    raise OverCpu()


def _address_space_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize in /proc/self/status")


def _cpu_used() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    cpu_s, memory_mb = int(sys.argv[1]), int(sys.argv[2])
    from transformers.utils.chat_template_utils import render_jinja_template

    _, hard_as = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (_address_space_bytes() + (memory_mb << 20), hard_as))
    _, hard_cpu = resource.getrlimit(resource.RLIMIT_CPU)
    signal.signal(signal.SIGXCPU, _over_cpu)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent ends us (closing our stdin, or SIGKILL)
    for line in sys.stdin:
        request = json.loads(line)
        try:
            resource.setrlimit(resource.RLIMIT_CPU, (math.ceil(_cpu_used() + cpu_s), hard_cpu))
            (text,), _ = render_jinja_template(conversations=[request["messages"]], chat_template=request["template"],
                                               add_generation_prompt=request["add_generation_prompt"],
                                               **request["variables"])
            reply = {"text": text}
        except OverCpu:
            reply = {"error": "cpu", "message": ""}
        except MemoryError:
            reply = {"error": "memory", "message": ""}
        except Exception as exc:  # noqa: BLE001 - the template's own error (raise_exception, undefined, ...)
            reply = {"error": "template", "message": f"{type(exc).__name__}: {exc}"}
        finally:
            resource.setrlimit(resource.RLIMIT_CPU, (hard_cpu, hard_cpu))
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
