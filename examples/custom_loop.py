"""Recipe: zload in a hand-written DeepSpeed ZeRO-3 training loop.

The model is built with its parameters born partitioned (``zload.init``), filled from the
pretrained checkpoint with ``zload.load_into`` (each rank reads only its own partitions), trained,
and saved with ``zload.save`` every few steps (each rank writes only its own partitions). At the
end the last save is loaded into a fresh model and compared with the trained one, bit for bit.

    python -m torch.distributed.run --nproc_per_node 2 examples/custom_loop.py --out DIR
    python examples/custom_loop.py --out DIR      # launches itself on 2 CPU ranks
"""

from __future__ import annotations

import os

import deepspeed
import torch
import torch.distributed as dist
from transformers import AutoConfig, LlamaForCausalLM

import recipe_world
import zload

DS_CONFIG = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 1,
    "zero_optimization": {"stage": 3},
    "zero_allow_untested_optimizer": True,  # the torch AdamW below
}
STEPS, SAVE_EVERY = 6, 3


def build(config) -> LlamaForCausalLM:
    with zload.init(DS_CONFIG):  # no init, no broadcast: a load writes every value next
        return LlamaForCausalLM(config)


def main(out: str) -> None:
    base = recipe_world.pretrained_llama(out)
    config = AutoConfig.from_pretrained(base)

    model = build(config)
    print(zload.load_into(model, base))  # this rank's LoadReport
    engine, *_ = deepspeed.initialize(model=model, config=DS_CONFIG,
                                      optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2))
    data = torch.Generator().manual_seed(dist.get_rank())  # each rank its own batches
    for step in range(1, STEPS + 1):
        ids = torch.randint(0, config.vocab_size, (2, 12), generator=data)
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
        if step % SAVE_EVERY == 0:
            zload.save(engine, os.path.join(out, f"step-{step}"))

    trained = recipe_world.gathered(engine.module)
    fresh = build(config)
    zload.load_into(fresh, os.path.join(out, f"step-{STEPS}"))
    reloaded = recipe_world.gathered(fresh)
    problems = [f"{name}: step-{STEPS} loaded back differs from the trained model"
                for name, value in trained.items() if not torch.equal(reloaded[name], value)]
    recipe_world.finish(problems, f"custom loop recipe: OK ({len(trained)} tensors bit-exact after reload)")


if __name__ == "__main__":
    raise SystemExit(recipe_world.main(__file__, __doc__.split("\n\n")[0], main))
