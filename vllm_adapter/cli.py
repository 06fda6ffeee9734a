"""`twinserve-vllm --model DIR [vllm serve flags] [scheduler=... preemption=... predictor=...]`:
vLLM's OpenAI-compatible server with a twinserve scheduler plug-in, named as in the simulator.

In twinserve's venv it composes the plug-in's config from conf/ and checks that vLLM can host it;
then it starts `vllm serve` (vLLM's CPU build, from --vllm-venv, made on first use) with
`--scheduler-cls vllm_adapter.scheduler.TwinserveScheduler`, the config in TWINSERVE_VLLM_PLUGIN,
and this checkout (and the folder it is run from, for a plug-in of your own) on PYTHONPATH.
The plug-in's max_num_seqs and max_num_batched_tokens become vLLM's unless a flag sets them.

    twinserve-vllm --model /path/to/checkpoint --port 8000 scheduler=sjf predictor=oracle
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from vllm_adapter import version_refusal
from vllm_adapter.config import build_host, plugin_config, plugin_env
from vllm_adapter.venv import vllm_python, with_policy_config_packages

REPO = Path(__file__).resolve().parents[1]
SCHEDULER_CLS = "vllm_adapter.scheduler.TwinserveScheduler"
# The plug-in's limits and the vLLM flags that carry them.
LIMIT_FLAGS = {"max_num_seqs": "--max-num-seqs",
               "max_num_batched_tokens": "--max-num-batched-tokens"}


def parse_args(argv: list[str] | None = None
               ) -> tuple[argparse.Namespace, list[str], list[str]]:
    """(the command's own arguments, the flags for vllm serve, the Hydra overrides)."""
    parser = argparse.ArgumentParser(prog="twinserve-vllm", description=__doc__.splitlines()[0],
                                     epilog="Other flags go to vllm serve; key=value arguments "
                                            "are the plug-in's Hydra overrides.")
    parser.add_argument("--model", type=Path, required=True,
                        help="a local Hugging Face checkpoint folder")
    parser.add_argument("--vllm-venv", type=Path, default=REPO / ".venv-vllm",
                        help="the venv with vLLM's CPU build (made when it has none)")
    args, rest = parser.parse_known_args(argv)
    overrides = [arg for arg in rest if "=" in arg and not arg.startswith("-")]
    return args, [arg for arg in rest if arg not in overrides], overrides


def flag_value(flags: list[str], name: str) -> str | None:
    """The value `flags` give `name` (`--name V` or `--name=V`), or None."""
    for index, flag in enumerate(flags):
        if flag == name and index + 1 < len(flags):
            return flags[index + 1]
        if flag.startswith(name + "="):
            return flag.split("=", 1)[1]
    return None


def model_max_len(model: Path, vllm_args: list[str]) -> int:
    """The max_model_len vLLM will use: --max-model-len, else the checkpoint's."""
    flag = flag_value(vllm_args, "--max-model-len")
    if flag is not None:
        return int(flag)
    config = json.loads((model / "config.json").read_text())
    return int(config.get("max_position_embeddings", 2048))


def vllm_version(python: Path) -> str:
    result = subprocess.run([str(python), "-c", "import vllm; print(vllm.__version__)"],
                            capture_output=True, text=True)
    return result.stdout.strip().splitlines()[-1] if result.returncode == 0 else "?"


def server_command(args: argparse.Namespace, vllm_args: list[str], overrides: list[str]
                   ) -> tuple[list[str], dict[str, str]]:
    """The command line and environment that start vLLM's server with the plug-in; ValueError
    (one line naming the argument or key) on bad input."""
    if not (args.model / "config.json").is_file():
        raise ValueError(f"--model: no model folder at {args.model} (a local Hugging Face "
                         f"checkpoint folder with config.json)")
    config = plugin_config(overrides)
    # Built here once so a bad name, argument or unhostable member stops before vLLM starts.
    build_host(config, block_size=16, num_blocks=1 << 20,
               max_model_len=model_max_len(args.model, vllm_args))
    python = vllm_python(args.vllm_venv)
    refusal = version_refusal(vllm_version(python))
    if refusal is not None:
        raise ValueError(f"--vllm-venv: {refusal}")
    with_policy_config_packages(python)
    limits = []
    for key, flag in LIMIT_FLAGS.items():
        value = config["scheduler"].get(key)
        if value is not None and flag_value(vllm_args, flag) is None:
            limits += [flag, str(value)]
    command = [str(python), "-m", "vllm.entrypoints.openai.api_server",
               "--model", str(args.model), "--scheduler-cls", SCHEDULER_CLS, *limits, *vllm_args]
    path = [os.getcwd(), str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]
    return command, {**os.environ, **plugin_env(config), "PYTHONPATH": os.pathsep.join(path)}


def main(argv: list[str] | None = None) -> None:
    args, vllm_args, overrides = parse_args(argv)
    # A user's own policy (scheduler._target_=my_policies.MyScheduler) lives in their folder.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        command, env = server_command(args, vllm_args, overrides)
    except (ValueError, RuntimeError) as error:
        print(f"twinserve-vllm: {' '.join(str(error).split())}", file=sys.stderr)
        sys.exit(2)
    print(f"twinserve-vllm: {' '.join(command[1:])}", flush=True)
    os.execve(command[0], command, env)


if __name__ == "__main__":
    main()
