"""`hetc launch PLAN_OR_SPEC --node GROUP[i]`: torchrun for one node of a mixed cluster.

A mixed cluster's nodes differ in GPU count, so each node's torchrun needs
its own `--nproc-per-node`; the agents may start in any order (placement by
discovery, runtime/placement.py, maps them onto the plan). The node's name
travels to its processes as HETC_NODE, so placement puts them on that plan
node. A plan directory runs as compiled; a spec runs elastically (`hetc run
SPEC --elastic`), re-planned on the nodes present at every start.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path

from hetc.commands import Subparsers
from hetc.errors import UsageError
from hetc.runtime.local import NODE_ENV

__all__ = ["register", "torchrun_command"]

# torch 2.13 + gloo: restarted workers cannot re-initialise on the agents' shared store (stale keys)
ENV_FIXED = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def register(sub: Subparsers) -> None:
    p = sub.add_parser(
        "launch", help="run (or print) torchrun for one node of a mixed cluster",
        description="Start torchrun for node GROUP[i] of the plan (or spec) with that node's process count and "
                    "the rendezvous settings every node shares.",
        epilog="examples:\n"
               "  hetc launch out/plan --node big[0] --rdzv head:29500      # on the 8-GPU node\n"
               "  hetc launch out/plan --node small[0] --rdzv head:29500    # on the 4-GPU node, any order\n"
               "  hetc launch job.het --node big[0] --rdzv head:29500 --run-args --checkpoint ckpt --every 50",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("target", type=Path, metavar="PLAN_OR_SPEC",
                   help="a plan directory (runs as compiled) or a spec (runs with --elastic)")
    p.add_argument("--node", required=True, metavar="GROUP[i]", help="the node this machine is, e.g. big[0]")
    p.add_argument("--rdzv", default="127.0.0.1:29500", metavar="HOST:PORT",
                   help="the rendezvous endpoint every node uses, on one of the nodes (default 127.0.0.1:29500: "
                        "every node on this machine)")
    p.add_argument("--rdzv-id", default="hetc", metavar="ID", help="the job's rendezvous id (the same on every node)")
    p.add_argument("--nnodes", metavar="N|MIN:MAX",
                   help="nodes in the job (default: the plan's nodes; for a spec 1:all of the cluster's)")
    p.add_argument("--max-restarts", type=int, metavar="K", help="worker restarts (default 0; 3 for a spec)")
    p.add_argument("--local-addr", metavar="ADDR", help="this node's address as the others reach it")
    p.add_argument("--print", action="store_true", help="print the torchrun command instead of running it")
    p.add_argument("--run-args", nargs=argparse.REMAINDER, default=[], metavar="ARG",
                   help="the rest of the line goes to `hetc run` (last)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
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

    node = parse_node_label(args.node)
    if node is None:
        raise UsageError(f"--node wants GROUP[i], such as big[0]; got '{args.node}'")
    _rdzv_endpoint(args.rdzv)
    elastic = args.target.is_file()
    nproc, nodes = _spec_node(args.target, node) if elastic else _plan_node(args.target, node)
    if elastic and not {"--checkpoint", "--every"} <= set(args.run_args):
        raise UsageError("a spec runs elastically and resumes from checkpoints: add "
                         "`--run-args --checkpoint DIR --every N`")
    restarts = args.max_restarts if args.max_restarts is not None else (3 if elastic else 0)
    argv = ["--nnodes", args.nnodes or (f"1:{nodes}" if elastic else str(nodes)), "--nproc-per-node", str(nproc),
            "--max-restarts", str(restarts), "--rdzv-backend", "c10d", "--rdzv-endpoint", args.rdzv,
            "--rdzv-id", args.rdzv_id]
    if args.local_addr:
        argv += ["--local-addr", args.local_addr]
    argv += ["-m", "hetc", "run", str(args.target), *(["--elastic"] if elastic else []), *args.run_args]
    return {NODE_ENV: args.node, **ENV_FIXED}, argv


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
