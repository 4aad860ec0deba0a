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


@dataclass(slots=True)  # not frozen: a frozen dataclass's __init__ is several times slower
class ScheduledChunk:
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
    """One step's work: entry i runs ``num_new[i]`` tokens of ``seqs[i]`` from position ``starts[i]``.

    Parallel lists rather than an object per sequence: a decode step plans every running sequence,
    and the engine hands these on to the model runner as they are.
    """

    seqs: list[Sequence] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)
    num_new: list[int] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def chunks(self) -> list[ScheduledChunk]:
        """The entries as objects (tests and tools; the engine reads the lists)."""
        return [ScheduledChunk(*e) for e in zip(self.seqs, self.starts, self.num_new)]

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new)

    def samples(self) -> list[bool]:
        """Per entry: whether it reaches its sequence's last token (so its logits pick the next one)."""
        return [a + n == len(s.token_ids) for s, a, n in zip(self.seqs, self.starts, self.num_new)]

    def token_ids(self) -> list[int]:
        """Every entry's tokens, one after another."""
        if len(self.seqs) == self.num_tokens:  # a decode step: one token each
            return [s.token_ids[a] for s, a in zip(self.seqs, self.starts)]
        return [t for s, a, n in zip(self.seqs, self.starts, self.num_new) for t in s.token_ids[a : a + n]]


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
        running = self.running
        blocks = self.blocks
        seq_ids = [s.seq_id for s in running]
        # Once for both paths: where the shortcut declines after growing some tables, their rooms
        # here are too small, which costs the general path one quick ``allocate`` each.
        starts, rooms = blocks.extents(seq_ids)
        if running and (not self.waiting or len(running) >= self.config.max_num_seqs):
            decode = self._decode_all(seq_ids, starts, rooms)
            if decode is not None:
                return decode
        budget = self.config.max_tokens_per_step
        plan: dict[int, tuple[Sequence, int, int]] = {}  # seq_id -> (sequence, start, tokens)
        preempted: list[Sequence] = []
        decoding: list[tuple[Sequence, int, int]] = []  # (sequence, tokens computed, tokens its blocks hold)
        prefilling: list[tuple[Sequence, int, int]] = []
        for s, start, room in zip(running, starts, rooms):
            left = len(s.token_ids) - start
            if left == 1:
                decoding.append((s, start, room))
            elif left > 1:
                prefilling.append((s, start, room))
        # A preemption below frees only its victim's blocks, so the others' starts and rooms stay true.
        RUNNING = SeqStatus.RUNNING
        for seq, start, room in decoding + prefilling:
            if seq.status is not RUNNING or budget == 0:
                continue  # preempted earlier in this step, or the budget is spent
            n = min(len(seq.token_ids) - start, budget)
            if start + n > room:  # it needs blocks (a decode step: one sequence in block_size)
                while not blocks.allocate(seq.seq_id, start + n):
                    victim = self.running[-1]  # the newest
                    self._preempt(victim)
                    preempted.append(victim)
                    if (dropped := plan.pop(victim.seq_id, None)) is not None:
                        budget += dropped[2]
                    if victim is seq:
                        break
                if seq.status is not RUNNING:
                    continue  # it was the victim
            plan[seq.seq_id] = (seq, start, n)
            budget -= n
        # Admit waiting sequences in order; none while this step had to preempt.
        while self.waiting and not preempted and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            start = blocks.admit(seq.seq_id, seq.token_ids)
            n = min(len(seq.token_ids) - start, budget)
            if not blocks.allocate(seq.seq_id, start + n):
                blocks.free(seq.seq_id)  # let go of the prefix hits; retry next step
                break
            self.waiting.popleft()
            if seq.num_admissions == 0:
                seq.num_cached_tokens = start
            seq.num_admissions += 1
            seq.status = SeqStatus.RUNNING
            bisect.insort(self.running, seq, key=lambda s: s.seq_id)
            plan[seq.seq_id] = (seq, start, n)
            budget -= n
        if not plan:
            return StepPlan(preempted=preempted)
        seqs, starts, num_new = map(list, zip(*plan.values()))
        return StepPlan(seqs, starts, num_new, preempted)

    def _decode_all(self, seq_ids: list[int], starts: list[int], rooms: list[int]) -> StepPlan | None:
        """The steady state, when nothing can be admitted (none waits, or the batch is full): every
        running sequence decodes its last token. The plan ``schedule`` would make, in fewer passes
        over the batch; None when this step is not that (a prompt left to compute, the budget too
        small, a block that only a preemption would free). ``seq_ids``, ``starts``, ``rooms``: the
        running sequences' ids and their ``BlockManager.extents``."""
        running, blocks = self.running, self.blocks
        if len(running) > self.config.max_tokens_per_step:
            return None
        if any(len(s.token_ids) != a + 1 for s, a in zip(running, starts)):
            return None
        for seq_id, start, room in zip(seq_ids, starts, rooms):
            # Its last block is full: about one sequence in block_size a step.
            if start >= room and not blocks.allocate(seq_id, start + 1):
                return None  # schedule preempts (blocks taken here stay with their sequences)
        return StepPlan(list(running), starts, [1] * len(running))

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
