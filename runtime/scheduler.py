"""Iteration-level scheduling: which sequences run in the next step, and how many tokens each.

Plain Python, no tensors. Every step: decodes first (one token each, oldest first), so a long prompt
cannot stall them; then prefill chunks of running sequences under the step's token budget; then new
sequences, first come first served, while sequences, tokens and blocks last. When a running sequence
needs a block and none is free, the newest running sequence is preempted: its blocks are freed
(full ones stay in the prefix cache) and it waits at the front of the queue to be recomputed.
"""

from __future__ import annotations

import bisect
import enum
from collections import deque
from dataclasses import dataclass, field

from .block_manager import BlockManager

__all__ = ["SchedulerConfig", "Scheduler", "Sequence", "SeqStatus", "ScheduledChunk", "StepPlan"]


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False, slots=True)
class Sequence:
    """What the scheduler knows of a request: its tokens and where it is."""

    seq_id: int  # arrival order; also its key in the block manager
    token_ids: list[int]  # prompt, then generated tokens
    num_prompt_tokens: int
    status: SeqStatus = SeqStatus.WAITING
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first admission
    num_admissions: int = 0  # > 1 after preemptions
    num_preemptions: int = 0


@dataclass(slots=True)  # not frozen: a frozen dataclass's __init__ is several times slower, and
class ScheduledChunk:  # a decode step makes one per running sequence
    """``num_tokens`` tokens of ``seq`` from position ``start`` run this step (do not modify)."""

    seq: Sequence
    start: int
    num_tokens: int

    @property
    def token_ids(self) -> list[int]:
        return self.seq.token_ids[self.start : self.start + self.num_tokens]

    @property
    def samples(self) -> bool:
        """Whether this chunk reaches the sequence's last token (so its logits pick the next one)."""
        return self.start + self.num_tokens == len(self.seq.token_ids)


@dataclass(slots=True)
class StepPlan:
    """One step's work."""

    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int = 64  # most running sequences
    max_tokens_per_step: int = 512  # token budget of one step


class Scheduler:
    """FCFS continuous batching with chunked prefill and recompute preemption."""

    def __init__(self, config: SchedulerConfig, blocks: BlockManager) -> None:
        self.config = config
        self.blocks = blocks
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # sorted by seq_id: oldest first

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> StepPlan:
        """Pick this step's chunks, allocating their blocks (preempting if needed)."""
        budget = self.config.max_tokens_per_step
        plan: dict[int, ScheduledChunk] = {}
        preempted: list[Sequence] = []
        decoding: list[tuple[Sequence, int]] = []  # (sequence, tokens computed)
        prefilling: list[tuple[Sequence, int]] = []
        num_computed = self.blocks.num_computed
        for s in self.running:
            start = num_computed(s.seq_id)
            left = len(s.token_ids) - start
            if left == 1:
                decoding.append((s, start))
            elif left > 1:
                prefilling.append((s, start))
        # A preemption below frees only its victim's blocks, so the others' starts stay true.
        for seq, start in decoding + prefilling:
            if seq.status is not SeqStatus.RUNNING or budget == 0:
                continue  # preempted earlier in this step, or the budget is spent
            n = min(len(seq.token_ids) - start, budget)
            while not self.blocks.allocate(seq.seq_id, start + n):
                victim = self.running[-1]  # the newest
                self._preempt(victim)
                preempted.append(victim)
                if (dropped := plan.pop(victim.seq_id, None)) is not None:
                    budget += dropped.num_tokens
                if victim is seq:
                    break
            else:
                plan[seq.seq_id] = ScheduledChunk(seq, start, n)
                budget -= n
        # Admit waiting sequences in order; none while this step had to preempt.
        while self.waiting and not preempted and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            start = self.blocks.admit(seq.seq_id, seq.token_ids)
            n = min(len(seq.token_ids) - start, budget)
            if not self.blocks.allocate(seq.seq_id, start + n):
                self.blocks.free(seq.seq_id)  # let go of the prefix hits; retry next step
                break
            self.waiting.popleft()
            if seq.num_admissions == 0:
                seq.num_cached_tokens = start
            seq.num_admissions += 1
            seq.status = SeqStatus.RUNNING
            bisect.insort(self.running, seq, key=lambda s: s.seq_id)
            plan[seq.seq_id] = ScheduledChunk(seq, start, n)
            budget -= n
        return StepPlan(list(plan.values()), preempted)

    def finish(self, seq: Sequence) -> None:
        """``seq`` is done: release its blocks (full ones stay cached)."""
        self._remove(seq)

    def abort(self, seq: Sequence) -> None:
        """Drop ``seq`` wherever it is and release its blocks now."""
        self._remove(seq)

    def _remove(self, seq: Sequence) -> None:
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
        seq.status = SeqStatus.FINISHED
        self.blocks.free(seq.seq_id)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.free(seq.seq_id)
        seq.status = SeqStatus.WAITING
        seq.num_preemptions += 1
        # Oldest first at the front: preemption goes newest first, so each goes before the last one.
        self.waiting.appendleft(seq)
