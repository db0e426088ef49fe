"""The config's path through the code: which modules a run's ExperimentConfig passes through.

    python benchmarks/config_path.py [--steps 2] [--show]

Runs the tiny default in one process (`launcher.type=inline`, the embedded engine and the
trainer on threads of this process) under a profile hook, and records every call of an
areal function that takes the ExperimentConfig as an argument, in the order they happen, on
every thread. Prints the modules the config passes through, and how many times the path
returns to a module it had left (A -> B -> A counts one): the coupling a maintainer follows
when reading where a setting acts. Sections handed on alone (cfg.trainer, cfg.ppo) are not
counted (a function that takes only its section depends only on it) unless --sections.
--show prints the path.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
from types import FrameType

from areal.config import ExperimentConfig
from areal.config_loader import Section


class ConfigPath:
    """The modules of the calls that take an ExperimentConfig, in call order."""

    def __init__(self, kind: type = ExperimentConfig) -> None:
        self.kind = kind  # ExperimentConfig, or Section for any section too
        self.calls: list[tuple[str, str]] = []  # (module, function)

    def hook(self, frame: FrameType, event: str, arg: object) -> None:
        if event != "call":
            return
        module = frame.f_globals.get("__name__", "")
        if not module.startswith("areal"):
            return
        code = frame.f_code
        n_args = code.co_argcount + code.co_kwonlyargcount
        local = frame.f_locals
        names = code.co_varnames[:n_args]
        if names[:1] == ("self",) and isinstance(local.get("self"), Section):
            return  # the config's own methods and properties
        if any(isinstance(local.get(name), self.kind) for name in names):
            self.calls.append((module, code.co_qualname))

    def walk(self) -> list[str]:
        """The modules in order, each run of calls within one module counted once."""
        out: list[str] = []
        for module, _ in self.calls:
            if not out or out[-1] != module:
                out.append(module)
        return out

    def returns(self) -> int:
        """Entries into a module the path had already visited and left."""
        seen: set[str] = set()
        n = 0
        for module in self.walk():
            n += module in seen
            seen.add(module)
        return n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--show", action="store_true", help="print every call on the path")
    parser.add_argument("--sections", action="store_true", help="count calls taking a section")
    args = parser.parse_args()
    from areal import train

    path = ConfigPath(Section if args.sections else ExperimentConfig)
    with tempfile.TemporaryDirectory() as root:
        argv = [
            "--config", "configs/tiny.yaml", "launcher.type=inline", f"fileroot={root}",
            f"total_train_steps={args.steps}", "trainer.save_freq_steps=0",
        ]  # fmt: skip
        threading.setprofile(path.hook)
        sys.setprofile(path.hook)
        try:
            train.main(argv)
        finally:
            sys.setprofile(None)
            threading.setprofile(None)
    if args.show:
        for module, fn in path.calls:
            print(f"  {module}.{fn}")
    modules = sorted(set(path.walk()))
    what = "a section of the config" if args.sections else "the config"
    print(f"{len(path.calls)} calls take {what}, in {len(modules)} modules; the path "
          f"returns {path.returns()} times to a module it left")  # fmt: skip
    print("modules: " + ", ".join(m.removeprefix("areal.") for m in modules))


if __name__ == "__main__":
    main()
