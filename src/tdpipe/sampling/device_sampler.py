"""Sampling on the last stage, on the device that computed the logits: greedy and plain-temperature rows.

SiPipe §5.1 moves sampling off the GPU to the engine's CPU, which samples micro-batch i while the stages run
the others: logits travel to the engine. The other choice keeps a row's sampling on the device: only its
token id travels. Which rows may: those whose token depends on nothing but their logits and temperature
(sampling/stage_rows.py decides, on the engine). This module is the device side.

A temperature row is sampled by the Gumbel-max trick: argmax(logits / T + G), G ~ Gumbel(0, 1) i.i.d. per
column, picks token j with probability softmax(logits / T)_j; G = -log E with E ~ Exp(1), the exponential
race the engine's Sampler runs. An argmax of perturbed columns is still an argmax, so it composes with what
the stages already do for greedy rows: tensor-parallel ranks each perturb their vocabulary shard with their
own noise and agree on the maximum (model/tensor_parallel.greedy_ids), the two parts of a split lm_head
each send their (max, id). Greedy rows (T = 0) are left untouched.

The noise of a step comes from `seed` (drawn by the engine per step from its own generator, so --seed makes
runs repeat) mixed with a `salt` per rank or head part (each shard's noise independent of the others'). On CPU
it is the engine sampler's hashed noise (sampling/race.py: one vector pass, keyed per row by (seed, salt, row));
torch's `exponential_` there draws a sequential stream, 0.33 s for 256 rows of 49,152. Elsewhere `exponential_`
from one generator per device, reseeded per step.
"""
from __future__ import annotations

import torch

from tdpipe.sampling.race import key_tensor, perturb_
from tdpipe.sampling.seeds import draw_key, draw_keys


class DeviceSampler:
    """Keeps one torch.Generator per device, reseeded for every step (no state carries between steps)."""

    def __init__(self) -> None:
        self._generators: dict[torch.device, torch.Generator] = {}

    def generator(self, device: torch.device, seed: int, salt: int) -> torch.Generator:
        g = self._generators.get(device)
        if g is None:
            g = self._generators[device] = torch.Generator(device=device)
        return g.manual_seed(draw_key(seed, salt))

    def perturb(self, logits: torch.Tensor, temperatures: list[float], seed: int, salt: int = 0) -> torch.Tensor:
        """`logits` [S, V_part] with rows T > 0 replaced by logits / T + Gumbel noise (a float32 copy); the
        same tensor when every row is greedy (T = 0). Its row-wise argmax is each row's token."""
        hot = [i for i, t in enumerate(temperatures) if t > 0]
        if not hot:
            return logits
        dev = logits.device
        x = logits.to(torch.float32, copy=True)
        rows = torch.tensor(hot, device=dev) if len(hot) < len(temperatures) else None
        sub = x if rows is None else x[rows]
        temps = torch.tensor([temperatures[i] for i in hot], dtype=torch.float32, device=dev)
        if dev.type == "cpu":
            base = draw_key(seed, salt)
            keys = key_tensor(draw_keys([base] * len(hot), hot))
            sub = perturb_(sub.contiguous(), temps, keys)
        else:
            e = torch.empty_like(sub).exponential_(generator=self.generator(dev, seed, salt))
            # in place (the copy is ours): the same values as sub / T - log(e), two [S, V] tensors fewer
            sub = sub.div_(temps[:, None]).sub_(e.clamp_min_(torch.finfo(e.dtype).tiny).log_())
        if rows is None:
            return sub
        x[rows] = sub
        return x

    def sample(self, logits: torch.Tensor, temperatures: list[float], seed: int, salt: int = 0) -> torch.Tensor:
        """int64 [S] token ids of a whole-vocabulary `logits` (one part, no shards)."""
        return self.perturb(logits, temperatures, seed, salt).argmax(-1)


__all__ = ["DeviceSampler"]
