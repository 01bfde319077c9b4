"""What the recipes share and a user does not copy: a tiny pretrained Llama to start from, the
launch of a CPU world, and one verdict for all ranks.

Each recipe runs under torchrun as it would on a cluster::

    python -m torch.distributed.run --nproc_per_node 2 examples/custom_loop.py --out DIR

or plainly (``python examples/custom_loop.py --out DIR``), when it launches itself under torchrun on
this machine, as ``examples/demo.py`` does. ``--nodes N`` launches N torchrun agents here, each a
"node" with its own local folder (``node_folder``), as tests/test_node_local.py does.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import os
import socket
import subprocess
import sys
import warnings


def tiny_llama(folder: str, seed: int = 0, **overrides) -> str:
    """Save a tiny random Llama (2 layers, hidden 32) with ``save_pretrained``: the "pretrained"
    checkpoint the recipes start from, so nothing is downloaded."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=56, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         **overrides)
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def pretrained_llama(out: str, **overrides) -> str:
    """``OUT/base``, written by rank 0 (``tiny_llama``) while the other ranks wait."""
    import torch.distributed as dist

    folder = os.path.join(out, "base")
    if dist.get_rank() == 0:
        tiny_llama(folder, **overrides)
    dist.barrier()
    return folder


def gathered(model, wanted=lambda name: True) -> dict:
    """Whole copies of the parameters whose names are ``wanted``, for the recipes' checks (saving
    gathers nothing)."""
    import deepspeed

    params = {name: p for name, p in model.named_parameters() if wanted(name)}
    with deepspeed.zero.GatheredParameters(list(params.values())):
        return {name: p.data.clone() for name, p in params.items()}


def node_folder(out: str) -> str:
    """This node's local disk, simulated: ``OUT/node<k>`` for the k-th torchrun agent."""
    folder = os.path.join(out, f"node{os.environ.get('GROUP_RANK', '0')}")
    os.makedirs(folder, exist_ok=True)
    return folder


def quiet_ranks() -> None:
    """Keep the ranks' output to what the recipe prints: DeepSpeed's INFO logs, a deprecation
    warning from inside GatheredParameters, and transformers' advice."""
    import deepspeed
    import transformers

    deepspeed.utils.logger.setLevel(logging.WARNING)
    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")


def finish(problems: list[str], success: str) -> None:
    """Every rank reports its problems; rank 0 prints ``success`` if no rank has any. Ends the
    process without tearing down gloo: at exit a rank sometimes aborts while its peers close their
    sockets, which would fail a run that has already succeeded."""
    import torch
    import torch.distributed as dist

    for problem in problems:
        print(f"rank {dist.get_rank()}: MISMATCH: {problem}", file=sys.stderr)
    failed = torch.tensor([len(problems)])
    dist.all_reduce(failed)
    if dist.get_rank() == 0 and failed.item() == 0:
        print(success)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if failed.item() == 0 else 1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(script: str, args: argparse.Namespace) -> int:
    """Start ``args.nodes`` torchrun agents on this machine, ``world_size / nodes`` CPU ranks each."""
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    port = _free_port()
    agents = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", str(args.nodes),
                                "--node_rank", str(node), "--nproc_per_node", str(args.world_size // args.nodes),
                                "--master_addr", "127.0.0.1", "--master_port", str(port),
                                script, "--out", args.out], env=env)
              for node in range(args.nodes)]
    return max(agent.wait() for agent in agents)


def main(script: str, description: str, rank_main, nodes: int = 1) -> int:
    """Under torchrun, ``rank_main(out)`` on this rank; run plainly, launch the world first."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--out", required=True, help="folder for the model and every checkpoint")
    parser.add_argument("--world-size", type=int, default=2, help="ranks when launching (default 2)")
    parser.add_argument("--nodes", type=int, default=nodes, help=f"simulated nodes when launching (default {nodes})")
    args = parser.parse_args()
    args.out = os.path.abspath(args.out)
    if "RANK" not in os.environ:
        if args.world_size % args.nodes:
            parser.error("--world-size must be a multiple of --nodes")
        return _launch(os.path.abspath(script), args)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    with contextlib.redirect_stdout(io.StringIO()):  # its "shm_comm_op built" line, on every rank
        deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    quiet_ranks()
    return rank_main(args.out)
