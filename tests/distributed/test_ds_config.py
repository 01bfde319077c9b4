"""zload.ds_config: a DeepSpeed config checked before DeepSpeed reads it. The configs of the two
tables are also given to DeepSpeed's own parser: what zload refuses, DeepSpeed refuses too (with an
error naming no key); what zload takes, DeepSpeed takes, and reads the same way."""

from __future__ import annotations

from tests.support.harness import run_world
from tests.unit.test_ds_config import REFUSED, TAKEN


def _deepspeed_readings(configs) -> list:
    """DeepSpeed's reading of each config, (ZeRO stage, the dtype it enables), or the name of the
    error it raised."""
    from deepspeed.runtime.config import DeepSpeedConfig

    readings = []
    for config in configs:
        try:
            parsed = DeepSpeedConfig(config)
        except Exception as e:  # noqa: BLE001 -- whatever DeepSpeed raises
            readings.append(type(e).__name__)
            continue
        enabled = [dtype for dtype, on in (("bfloat16", parsed.bfloat16_config.enabled),
                                          ("float16", parsed.float16_config.enabled)) if on]
        readings.append((parsed.zero_optimization_stage, (enabled or [None])[0]))
    return readings


def test_deepspeed_refuses_what_zload_refuses_and_reads_what_it_takes_alike():
    """Not stricter than DeepSpeed, nor reading otherwise: DeepSpeed's own parser of each config
    above, in a world of 2 (it reads the world size; without one, some keys go unread)."""
    # not the int: DeepSpeed takes it for a file descriptor, and reads (here: blocks on) fd 3
    refused, taken = [case[0] for case in REFUSED if isinstance(case[0], dict)], [case[0] for case in TAKEN]
    for readings in run_world(2, _deepspeed_readings, refused + taken):
        assert all(isinstance(reading, str) for reading in readings[:len(refused)]), readings
        assert readings[len(refused):] == [(stage, dtype) for _, stage, dtype, _ in TAKEN]
