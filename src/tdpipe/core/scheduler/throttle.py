"""`throttle`: gLLM's Token Throttling (gLLM §3.1-3.2).

Every micro-batch merges decodes and prefill chunks, like `hybrid`, but sizes both from global state so
that the pp micro-batches in flight carry equal work and KV never runs dry:
  prefill tokens  #P = max(min(#WP / #T, #MaxP * (KVfree - KVthresh) / (1 - KVthresh)), #MinP)   (Eq. 3)
                  and no prefill at all while KVfree < KVthresh;
  decode tokens   #D = #RD / pp                                                                  (Eq. 4)
#WP: prompt tokens still waiting to be prefilled; #RD: running requests ready to decode; KVfree: the free
fraction of KV blocks. The paper's defaults #T=8, #MaxP=2048, #MinP=32, KVthresh=0.05 are ThrottleKnobs'.
"""
from __future__ import annotations

from dataclasses import dataclass

from tdpipe.config import SchedulerConfig
from tdpipe.core.block_manager import BlockManager
from tdpipe.core.scheduler.hybrid import HybridScheduler
from tdpipe.core.scheduler.registry import register_policy
from tdpipe.options import option


@dataclass
class ThrottleKnobs:
    """gLLM's #T, #MaxP, #MinP and KVthresh (Eq. 3): `--throttle-T` ... on the command line, keywords of LLM()."""

    throttle_T: float = option(8.0, "throttle: #T, spread the waiting prefill tokens #WP over this many batches "
                                    "(Eq. 3; default: %(default)s)", "--throttle-T", type=float)
    max_prefill_tokens: int = option(2048, "throttle: #MaxP, most prefill tokens in a batch when the KV cache is "
                                           "empty (Eq. 3; default: %(default)s)", "--max-prefill-tokens", type=int)
    min_prefill_tokens: int = option(32, "throttle: #MinP, fewest prefill tokens in a batch while prompts wait "
                                         "(Eq. 3; default: %(default)s)", "--min-prefill-tokens", type=int)
    kv_thresh: float = option(0.05, "throttle: KVthresh, no prefill while the free KV fraction is below it "
                                    "(Eq. 3; default: %(default)s)", "--kv-thresh", type=float)

    def __post_init__(self) -> None:
        def check(ok: bool, msg: str) -> None:
            if not ok:
                raise ValueError(msg)

        check(self.throttle_T > 0, f"throttle_T (#T) must be > 0, got {self.throttle_T}")
        check(self.max_prefill_tokens >= 1, f"max_prefill_tokens (#MaxP) must be >= 1, got {self.max_prefill_tokens}")
        check(1 <= self.min_prefill_tokens <= self.max_prefill_tokens,
              f"min_prefill_tokens (#MinP) must be in [1, max_prefill_tokens={self.max_prefill_tokens}], "
              f"got {self.min_prefill_tokens}")
        check(0.0 <= self.kv_thresh < 1.0, f"kv_thresh (KVthresh) must be in [0, 1), got {self.kv_thresh}")


@register_policy(
    "throttle", default_token_budget=ThrottleKnobs.max_prefill_tokens + 256,  # a ceiling only: Eq. 3 sizes
    knobs=ThrottleKnobs,
    help="gLLM's Token Throttling (gLLM §3.1-3.2): prefill tokens per batch from Eq. 3 (--throttle-T, "
         "--max-prefill-tokens, --min-prefill-tokens, --kv-thresh), decodes #RD/pp (Eq. 4)",
    budget_help="a ceiling of #MaxP + 256 decodes, Eq. 3 sizes each batch")
class ThrottleScheduler(HybridScheduler):
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, **parts) -> None:
        super().__init__(config, block_manager, **parts)
        self.knobs: ThrottleKnobs = config.knobs or ThrottleKnobs()  # PolicySpec.build configured them

    def decode_limit(self) -> int:
        """#D = #RD / pp (Eq. 4), rounded up so no decode is left behind."""
        rd = sum(1 for s in self.running if self._is_decoding(s))
        return max(1, min(self.config.max_num_seqs, -(-rd // self.config.pipeline_depth)))

    def waiting_prefill_tokens(self) -> int:
        """#WP: prompt tokens without KV, queued or partly prefilled; a queued request's cached prefix is not
        counted (it will not be prefilled: BlockManager.probe_cached_tokens)."""
        probe = self.bm.probe_cached_tokens if self.bm.enable_prefix_caching else None
        wp = sum(s.num_tokens - s.num_computed_tokens - (probe(s) if probe and not s.needs_prompt_logits else 0)
                 for s in self.waiting)
        return wp + sum(s.num_tokens - s.num_computed_tokens for s in self.running if self._is_prefilling(s))

    def prefill_budget(self, num_decodes: int) -> int:
        """#P (Eq. 3); zero below the KV threshold."""
        cfg, k = self.config, self.knobs
        wp = self.waiting_prefill_tokens()
        if wp == 0:
            return 0
        kv_free = self.bm.num_free_blocks / self.bm.num_blocks
        if kv_free < k.kv_thresh:
            # no prefill below KVthresh, unless nothing else could run (all running prompts half-prefilled):
            # then #MinP keeps the engine moving (chunks may preempt newer sequences for room)
            idle = num_decodes == 0 and not any(s.in_flight for s in self.running)
            return min(k.min_prefill_tokens, cfg.max_num_batched_tokens) if idle else 0
        by_queue = wp / k.throttle_T
        by_kv = k.max_prefill_tokens * (kv_free - k.kv_thresh) / (1 - k.kv_thresh)
        p = int(max(min(by_queue, by_kv), k.min_prefill_tokens))
        return max(0, min(p, cfg.max_num_batched_tokens - num_decodes))


__all__ = ["ThrottleKnobs", "ThrottleScheduler"]
