"""`hetc launch PLAN_OR_SPEC --node GROUP[i]`: torchrun for one node of a mixed cluster.

A mixed cluster's nodes differ in GPU count, so each node's torchrun needs
its own `--nproc-per-node`; the agents may start in any order (placement by
discovery, runtime/placement.py, maps them onto the plan). The node's name
travels to its processes as HETC_NODE, so placement puts them on that plan
node. A plan directory runs as compiled; a spec runs elastically (`hetc run
SPEC --elastic`), re-planned on the nodes present at every start.

`--emit slurm|jobset|skypilot` writes the file that starts every node of the
plan instead, one scheduler component per node group (hetc/launchfiles.py).
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path

from hetc.commands import Subparsers
from hetc.commands.argtypes import file_or_stdout
from hetc.ir.errors import UsageError
from hetc.launchfiles import EMITS, IMAGE_PLACEHOLDER, Component, LaunchJob, emitted, slurm_minutes
from hetc.runtime.local import NODE_ENV

__all__ = ["launch_job", "register", "torchrun_command"]

# torch 2.13 + gloo: restarted workers cannot re-initialise on the agents' shared store (stale keys)
ENV_FIXED = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
DEFAULT_RDZV = "127.0.0.1:29500"


def register(sub: Subparsers) -> None:
    p = sub.add_parser(
        "launch", help="run (or print) torchrun for one node of a mixed cluster",
        description="Start torchrun for node GROUP[i] of the plan (or spec) with that node's process count and "
                    "the rendezvous settings every node shares.",
        epilog="examples:\n"
               "  hetc launch out/plan --node big[0] --rdzv head:29500      # on the 8-GPU node\n"
               "  hetc launch out/plan --node small[0] --rdzv head:29500    # on the 4-GPU node, any order\n"
               "  hetc launch job.het --node big[0] --rdzv head:29500 --run-args --checkpoint ckpt --every 50\n"
               "  hetc launch out/plan --emit slurm -o job.sbatch               # every node: a SLURM hetjob\n"
               "  hetc launch out/plan --emit jobset --image reg/hetc:1 -o js.yaml   # a Kubernetes JobSet",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("target", type=Path, metavar="PLAN_OR_SPEC",
                   help="a plan directory (runs as compiled) or a spec (runs with --elastic)")
    p.add_argument("--node", metavar="GROUP[i]",
                   help="the node this machine is, e.g. big[0] (required unless --emit)")
    p.add_argument("--rdzv", metavar="HOST:PORT",
                   help=f"the rendezvous endpoint every node uses, on one of the nodes (default {DEFAULT_RDZV}: "
                        "every node on this machine; with --emit, the first node of the first node group, "
                        "port 29500)")
    p.add_argument("--rdzv-id", default="hetc", metavar="ID", help="the job's rendezvous id (the same on every node)")
    p.add_argument("--nnodes", metavar="N|MIN:MAX",
                   help="nodes in the job (default: the plan's nodes; for a spec 1:all of the cluster's)")
    p.add_argument("--max-restarts", type=int, metavar="K", help="worker restarts (default 0; 3 for a spec)")
    p.add_argument("--local-addr", metavar="ADDR", help="this node's address as the others reach it")
    p.add_argument("--print", action="store_true", help="print the torchrun command instead of running it")
    p.add_argument("--emit", choices=EMITS,
                   help="write the launch file for every node instead: a SLURM heterogeneous job script "
                        "(`#SBATCH hetjob` components), a Kubernetes JobSet (a replicated job per node group) or "
                        "SkyPilot tasks (one per node group); each node runs `hetc launch --node GROUP[i]`")
    p.add_argument("-o", "--output", type=file_or_stdout, metavar="FILE",
                   help="with --emit: write to FILE (default, or `-`: stdout)")
    p.add_argument("--image", default=IMAGE_PLACEHOLDER, metavar="IMAGE",
                   help="with --emit jobset: the container image with hetc and the plan (default: a placeholder "
                        "to replace)")
    p.add_argument("--partition", metavar="NAME", help="with --emit slurm: the partition of every component")
    p.add_argument("--time", metavar="LIMIT",
                   help="with --emit slurm: the job's time limit, as SLURM's --time (MIN, H:MM:SS, D-HH:MM, ...); "
                        "the runs stop, save and exit 0 before it (`hetc run --exit-after`, 5 %% of it earlier, "
                        "at least 5 and at most 30 minutes); needs --run-args --checkpoint DIR")
    p.add_argument("--run-args", nargs=argparse.REMAINDER, default=[], metavar="ARG",
                   help="the rest of the line goes to `hetc run` (last)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.emit:
        return _emit(args)
    if args.time:
        raise UsageError(f"{_TIME_IS_SLURMS} (a node launched by hand takes `--run-args --exit-after MIN`)")
    env, argv = torchrun_command(args)
    if args.print:
        print(" ".join([*(f"{k}={shlex.quote(v)}" for k, v in env.items()), "torchrun",
                        *(shlex.quote(a) for a in argv)]))
        return 0
    _refuse_a_taken_port(args.rdzv)
    sys.stdout.flush()
    os.execvpe(sys.executable, [sys.executable, "-m", "torch.distributed.run", *argv], {**os.environ, **env})
    return 1   # not reached


def torchrun_command(args: argparse.Namespace) -> tuple[dict[str, str], list[str]]:
    """(environment, torchrun arguments) for `args`; a UsageError for a node the plan has not."""
    from hetc.runtime.placement import parse_node_label

    if args.node is None:
        raise UsageError("--node GROUP[i] is required: the node this machine is (or --emit a launch file)")
    args.rdzv = args.rdzv or DEFAULT_RDZV
    node = parse_node_label(args.node)
    if node is None:
        raise UsageError(f"--node wants GROUP[i], such as big[0]; got '{args.node}'")
    _rdzv_endpoint(args.rdzv)
    elastic = args.target.is_file()
    nproc, nodes = _spec_node(args.target, node) if elastic else _plan_node(args.target, node)
    if elastic:
        _require_checkpoints(args.run_args)
    restarts = args.max_restarts if args.max_restarts is not None else (3 if elastic else 0)
    argv = ["--nnodes", args.nnodes or (f"1:{nodes}" if elastic else str(nodes)), "--nproc-per-node", str(nproc),
            "--max-restarts", str(restarts), "--rdzv-backend", "c10d", "--rdzv-endpoint", args.rdzv,
            "--rdzv-id", args.rdzv_id]
    if args.local_addr:
        argv += ["--local-addr", args.local_addr]
    argv += ["-m", "hetc", "run", str(args.target), *(["--elastic"] if elastic else []), *args.run_args]
    return {NODE_ENV: args.node, **ENV_FIXED}, argv


def _require_checkpoints(run_args: list[str]) -> None:
    if not {"--checkpoint", "--every"} <= set(run_args):
        raise UsageError("a spec runs elastically and resumes from checkpoints: add "
                         "`--run-args --checkpoint DIR --every N`")


def _emit(args: argparse.Namespace) -> int:
    if args.node is not None or args.print or args.local_addr:
        raise UsageError("--emit writes the file for every node: leave out --node, --print and --local-addr")
    _check_emitted_names(args)
    if args.output is not None:
        from hetc.compiler import spec_inputs
        from hetc.ir.outdir import check_output_file

        check_output_file(args.output, "-o", spec_inputs(Path(args.target)))   # Note [output files]
    text = emitted(args.emit, launch_job(args), args.image, args.partition, args.time)
    if args.output is None:
        sys.stdout.write(text)
        return 0
    args.output.write_text(text)
    if args.emit == "slurm":
        args.output.chmod(args.output.stat().st_mode | 0o111)
    print(f"wrote {args.output}: {_SUBMIT[args.emit].format(args.output)}")
    return 0


_SUBMIT = {"slurm": "submit it with `sbatch {}`", "jobset": "apply it with `kubectl apply -f {}`",
           "skypilot": "`sky launch` each of its tasks, the first one first (docs/launch.md)"}


# What a launch file may carry of the command line: the values go into shell lines, `#SBATCH` lines and YAML
# as they are, so a newline or a quote would start a line or a command of its own.
_NAMES = {"--rdzv-id": (r"[A-Za-z0-9][A-Za-z0-9._-]*", "letters, digits, '.', '_' and '-'"),
          "--partition": (r"[A-Za-z0-9._-]+(,[A-Za-z0-9._-]+)*",
                          "letters, digits, '.', '_' and '-' (a comma-separated list for several)"),
          "--image": (r"[A-Za-z0-9][A-Za-z0-9._/:@+-]*", "an image reference: letters, digits and . _ / : @ + -"),
          "--rdzv": (r"\[?[A-Za-z0-9._:-]+\]?:[0-9]+", "HOST:PORT, the host a name or an address"),
          "--time": (r"[0-9:-]+", "SLURM's time forms: MIN, MIN:SS, H:MM:SS, D-H, D-H:MM, D-H:MM:SS")}


def _check_emitted_names(args: argparse.Namespace) -> None:
    """A UsageError for a value a launch file cannot carry as it is."""
    import re

    for flag, value in (("--rdzv-id", args.rdzv_id), ("--partition", args.partition), ("--image", args.image),
                        ("--rdzv", args.rdzv), ("--time", args.time)):
        pattern, allowed = _NAMES[flag]
        if value is not None and re.fullmatch(pattern, value) is None:
            raise UsageError(f"{flag} {value!r}: a launch file carries {allowed}")


def launch_job(args: argparse.Namespace) -> LaunchJob:
    """The launch file's job: a component per node group the plan (or the spec's cluster) has."""
    elastic = args.target.is_file()
    if elastic:
        _require_checkpoints(args.run_args)
    components = _spec_components(args.target) if elastic else _plan_components(args.target)
    head, port = _rdzv_endpoint(args.rdzv) if args.rdzv else (None, 29500)
    options = ["--rdzv-id", args.rdzv_id]
    if args.nnodes:
        options += ["--nnodes", args.nnodes]
    if args.max_restarts is not None:
        options += ["--max-restarts", str(args.max_restarts)]
    run_args = [*args.run_args, *_exit_before(args.time, args.emit, args.run_args)]
    if run_args:
        options += ["--run-args", *run_args]
    return LaunchJob(str(args.target), components, args.rdzv_id, head, port, tuple(options))


_TIME_IS_SLURMS = "--time is the time limit of a SLURM job: it goes with --emit slurm"


def _exit_before(limit: str | None, emit: str | None, run_args: list[str]) -> list[str]:
    """The `hetc run` options that stop the runs before the job's time limit: Note [A time limit]."""
    if limit is None:
        return []
    if emit != "slurm":
        raise UsageError(_TIME_IS_SLURMS)
    if "--checkpoint" not in run_args:
        raise UsageError("--time stops the runs before the limit to save them: add --run-args --checkpoint DIR")
    minutes = slurm_minutes(limit)
    if "--exit-after" in run_args or "--exit-duration-in-mins" in run_args:
        return []       # the user's own
    margin = min(30.0, max(5.0, 0.05 * minutes))
    if minutes <= margin:
        raise UsageError(f"--time {limit}: a run needs more than {margin:g} minutes to train, save and exit")
    return ["--exit-after", f"{minutes - margin:g}"]


def _plan_components(plan_dir: Path) -> tuple[Component, ...]:
    from hetc.plandir import read_plan

    if not (plan_dir / "plan.het").is_file():
        raise UsageError(f"{plan_dir} is neither a spec file nor a plan directory (`hetc compile SPEC -o DIR`)")
    _, checked = read_plan(plan_dir)
    used = {g.host for g in checked.pipeline.world}
    cluster = checked.topology.cluster
    components = []
    for group in cluster.nodes:
        nodes = sorted(i for name, i in used if name == group.name)
        if nodes and nodes != list(range(len(nodes))):
            raise UsageError(f"the plan runs on {', '.join(f'{group.name}[{i}]' for i in nodes)}; a launch file "
                             f"numbers a group's nodes from 0: give the plan {group.name}[0] first")
        if nodes:
            components.append(Component(group.name, group.device, len(nodes), group.gpus))
    return tuple(components)


def _spec_components(spec_path: Path) -> tuple[Component, ...]:
    from hetc.compiler import load_checked

    loaded, _ = load_checked(spec_path)
    cluster = loaded.spec.cluster
    if cluster is None:
        raise UsageError(f"{spec_path} has no cluster block")
    return tuple(Component(n.name, n.device, n.count, n.gpus) for n in cluster.nodes)


def _rdzv_endpoint(text: str) -> tuple[str, int]:
    """(host, port) of `--rdzv HOST:PORT` (an IPv6 host in brackets: [::1]:29500)."""
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise UsageError(f"--rdzv wants HOST:PORT, such as head:29500; got '{text}'")
    return host.strip("[]"), int(port)


def _refuse_a_taken_port(rdzv: str) -> None:
    """A UsageError at once where torchrun would wait minutes on a taken port (Note [probing the
    rendezvous port])."""
    from hetc.runtime.local import free_port
    from hetc.runtime.rdzv_port import rendezvous_port_problem

    host, port = _rdzv_endpoint(rdzv)
    problem = rendezvous_port_problem(host, port)
    if problem is not None:
        raise UsageError(f"--rdzv {rdzv}: {problem}; choose a free port, the same for every node, "
                         f"e.g. --rdzv {host}:{free_port()}")


def _plan_node(plan_dir: Path, node: tuple[str, int]) -> tuple[int, int]:
    """(processes on `node`, nodes of the plan) for a compiled plan."""
    from hetc.plandir import read_plan

    if not (plan_dir / "plan.het").is_file():
        raise UsageError(f"{plan_dir} is neither a spec file nor a plan directory (`hetc compile SPEC -o DIR`)")
    _, checked = read_plan(plan_dir)
    world = checked.pipeline.world
    locals_ = [g.local for g in world if g.host == node]
    if not locals_:
        used = sorted({f"{g.group}[{g.node}]" for g in world})
        raise UsageError(f"the plan runs nothing on {node[0]}[{node[1]}]; its nodes are {', '.join(used)}")
    return max(locals_) + 1, len({g.host for g in world})


def _spec_node(spec_path: Path, node: tuple[str, int]) -> tuple[int, int]:
    """(GPUs of `node`, nodes of the cluster) for a spec."""
    from hetc.compiler import load_checked

    loaded, _ = load_checked(spec_path)
    cluster = loaded.spec.cluster
    if cluster is None:
        raise UsageError(f"{spec_path} has no cluster block")
    group = next((n for n in cluster.nodes if n.name == node[0]), None)
    if group is None or node[1] >= group.count:
        have = ", ".join(f"{n.name}[0..{n.count - 1}]" for n in cluster.nodes)
        raise UsageError(f"the cluster has no node {node[0]}[{node[1]}]; it has {have}")
    return group.gpus, sum(n.count for n in cluster.nodes)
