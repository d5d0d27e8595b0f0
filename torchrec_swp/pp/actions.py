"""The vocabulary of a pipeline-parallel program: actions, placements, programs.

An **action** is one step of one rank: ``<stage><kind>[<microbatch>]``, e.g. ``0F1`` (stage 0
forwards microbatch 1) or ``3SB2`` (stage 3 sends microbatch 2's input gradient to stage 2).
Kinds, roughly:

  ``F``   forward of the stage (the dense part when the stage also has ``E``)
  ``E``   sparse forward: the stage's embedding lookup; needs no input from another stage
  ``B``   full backward: input and weight gradients
  ``I``   backward-input: input gradients only (zero-bubble split; its ``W`` follows)
  ``W``   backward-weight: the weight gradients of an earlier ``I``
  ``SF``  send the stage's output activation to stage + 1
  ``RF``  post the receive of stage - 1's activation (the stage's ``F`` waits for it)
  ``SB``  send the stage's input gradient to stage - 1
  ``RB``  post the receive of stage + 1's gradient (the stage's ``B``/``I`` waits for it)
  ``G``   gradient sync: the data-parallel all-reduce of the stage's gradients (no microbatch)
  ``O``   optimizer step of the stage (no microbatch)

``E``/``F``/``B``/``I``/``W`` are *compute*; ``SF``/``RF``/``SB``/``RB`` are *P2P*; ``G`` and ``O``
end a step. The text is torch.distributed.pipelining's ``_Action`` form for the kinds both have
(``F``, ``B``, ``I``, ``W``; torch spells the P2P kinds ``SEND_F`` ... and ``G`` ``REDUCE_GRAD``):
``TORCH_KINDS`` is the one-to-one table, ``to_torch_text``/``from_torch_text`` the round trip.

A **program** holds, per rank, the actions that rank runs in order, and the placement of
stages on ranks. Its text form (``program_to_text``/``program_from_text``) round-trips exactly::

    program 1F1B microbatches=2 placement=0,1
    rank 0: 0F0 0SF0 0F1 0SF1 0RB0 0B0 0RB1 0B1
    rank 1: 1RF0 1F0 1B0 1SB0 1RF1 1F1 1B1 1SB1

Constructors check types and shapes only; what a program means is checked by ``validate``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum

from torchrec_swp.pp.errors import PPError


class Kind(str, Enum):
    FORWARD = "F"
    SPARSE = "E"
    BACKWARD = "B"
    BACKWARD_INPUT = "I"
    BACKWARD_WEIGHT = "W"
    SEND_F = "SF"
    RECV_F = "RF"
    SEND_B = "SB"
    RECV_B = "RB"
    GRAD_SYNC = "G"
    STEP = "O"


# the one-letter names are the action letters of the zero-bubble paper and of torch's schedules
F, E, B, I, W = Kind.FORWARD, Kind.SPARSE, Kind.BACKWARD, Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT  # noqa: E741
SF, RF, SB, RB = Kind.SEND_F, Kind.RECV_F, Kind.SEND_B, Kind.RECV_B
G, O = Kind.GRAD_SYNC, Kind.STEP  # noqa: E741

COMPUTE = frozenset({F, E, B, I, W})
P2P = frozenset({SF, RF, SB, RB})
SENDS = frozenset({SF, SB})
RECVS = frozenset({RF, RB})
#: Kinds that carry no microbatch.
PER_STEP = frozenset({G, O})
#: Kinds that compute the input gradient a stage hands to stage - 1.
INPUT_GRAD = frozenset({B, I})
#: Kinds that finish a microbatch's weight gradients (and free its activation).
WEIGHT_GRAD = frozenset({B, W})

# longest kinds first, so that "SF" is not read as "S" + "F"
_ACTION = re.compile(r"(0|[1-9][0-9]*)(SF|RF|SB|RB|F|E|B|I|W|G|O)(0|[1-9][0-9]*)?\Z")


@dataclass(frozen=True, slots=True)
class Action:
    """``kind`` of ``stage`` for ``microbatch`` (None for ``G`` and ``O``). ``str`` is the compact
    text (``0F1``); ``Action.from_text(str(a)) == a``."""

    stage: int
    kind: Kind
    microbatch: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.kind, Kind):
            object.__setattr__(self, "kind", _kind(self.kind))
        for name, value in (("stage", self.stage), ("microbatch", self.microbatch)):
            if value is None and name == "microbatch":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise PPError(f"action {name} must be an int >= 0, got {value!r}", action=f"{self.stage}{self.kind}")
        if (self.microbatch is None) != (self.kind in PER_STEP):
            need = "no microbatch" if self.kind in PER_STEP else "a microbatch"
            raise PPError(f"action kind {self.kind.value} takes {need}", action=f"{self.stage}{self.kind.value}")

    def __str__(self) -> str:
        return f"{self.stage}{self.kind.value}{'' if self.microbatch is None else self.microbatch}"

    __repr__ = __str__

    @staticmethod
    def from_text(text: str) -> Action:
        m = _ACTION.match(text.strip())
        if m is None:
            raise PPError(
                f"bad action {text!r}: expected <stage><kind>[<microbatch>] such as 0F1, 1RB0, 2G "
                "(kinds F E B I W SF RF SB RB G O; no leading zeros)",
                action=text,
            )
        stage, kind, mb = m.groups()
        return Action(int(stage), Kind(kind), None if mb is None else int(mb))

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE

    @property
    def is_p2p(self) -> bool:
        return self.kind in P2P

    @property
    def peer_stage(self) -> int:
        """The stage at the other end of a send or receive."""
        match self.kind:
            case Kind.SEND_F | Kind.RECV_B:
                return self.stage + 1
            case Kind.RECV_F | Kind.SEND_B:
                return self.stage - 1
            case _:
                raise PPError(f"{self} is not a send or a receive", action=str(self))

    def matching(self) -> Action:
        """The other half of a send or receive: ``0SF1`` <-> ``1RF1``, ``1SB1`` <-> ``0RB1``."""
        other = {SF: RF, RF: SF, SB: RB, RB: SB}.get(self.kind)
        if other is None:
            raise PPError(f"{self} is not a send or a receive", action=str(self))
        return Action(self.peer_stage, other, self.microbatch)

    @property
    def direction(self) -> str:
        """``"F"`` for activations, ``"B"`` for gradients (P2P kinds only)."""
        if self.kind not in P2P:
            raise PPError(f"{self} is not a send or a receive", action=str(self))
        return self.kind.value[1]


#: Our kind -> torch.distributed.pipelining's ``_ComputationType`` text, one to one (``E`` and ``O``
#: have none: torch has no sparse forward and leaves the optimizer outside its schedules).
TORCH_KINDS: dict[Kind, str] = {
    F: "F", B: "B", I: "I", W: "W",
    SF: "SEND_F", RF: "RECV_F", SB: "SEND_B", RB: "RECV_B",
    G: "REDUCE_GRAD",
}  # fmt: skip
_FROM_TORCH = {text: kind for kind, text in TORCH_KINDS.items()}
_TORCH_ACTION = re.compile(r"(0|[1-9][0-9]*)(SEND_F|RECV_F|SEND_B|RECV_B|REDUCE_GRAD|[A-Z_]+?)(0|[1-9][0-9]*)?\Z")


def to_torch_text(action: Action) -> str:
    """``action`` in torch.distributed.pipelining's action text (``_Action.from_str`` reads it):
    ``0SF1`` -> ``0SEND_F1``, ``1G`` -> ``1REDUCE_GRAD``. PPError for ``E`` and ``O``."""
    text = TORCH_KINDS.get(action.kind)
    if text is None:
        raise PPError(
            f"action {action} has no torch.distributed.pipelining counterpart (kind {action.kind.value})",
            action=str(action),
        )
    return f"{action.stage}{text}{'' if action.microbatch is None else action.microbatch}"


def from_torch_text(text: str) -> Action:
    """The action torch.distributed.pipelining's text names (``0SEND_F1`` -> ``0SF1``). PPError for
    torch's kinds we do not have (``UNSHARD``, ``RESHARD``, ``OVERLAP_F_B``)."""
    m = _TORCH_ACTION.match(text.strip())
    kind = None if m is None else _FROM_TORCH.get(m.group(2))
    if m is None or kind is None:
        raise PPError(f"bad or unsupported torch action {text!r}: kinds {', '.join(_FROM_TORCH)}", action=text)
    return Action(int(m.group(1)), kind, None if m.group(3) is None else int(m.group(3)))


def _kind(value: object) -> Kind:
    try:
        return Kind(value)
    except ValueError:
        raise PPError(f"unknown action kind {value!r}", action=str(value)) from None


def act(text: str) -> tuple[Action, ...]:
    """Parse space-separated actions: ``act("0F0 0SF0")``."""
    return tuple(Action.from_text(t) for t in text.split())


# --------------------------------------------------------------------------- placement
def loop_placement(num_ranks: int, stages_per_rank: int = 1) -> tuple[int, ...]:
    """Stage ``s`` on rank ``s % num_ranks`` (Megatron's interleaving; 1F1B when one per rank)."""
    check_positive(num_ranks=num_ranks, stages_per_rank=stages_per_rank)
    return tuple(s % num_ranks for s in range(num_ranks * stages_per_rank))


def v_placement(num_ranks: int) -> tuple[int, ...]:
    """Two stages per rank in a V: rank ``r`` holds stages ``r`` and ``2R - 1 - r`` (ZBV, DualPipeV)."""
    check_positive(num_ranks=num_ranks)
    return tuple(s if s < num_ranks else 2 * num_ranks - 1 - s for s in range(2 * num_ranks))


def check_positive(**values: int) -> None:
    for name, v in values.items():
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise PPError(f"{name} must be an int >= 1, got {v!r}")


# ----------------------------------------------------------------------------- program
@dataclass(frozen=True, slots=True)
class Program:
    """Per-rank action lists (``ranks[r]`` runs in order on rank ``r``) and where stages live
    (``placement[s]`` is the rank of stage ``s``). ``name`` is a label (an identifier)."""

    name: str
    num_microbatches: int
    placement: tuple[int, ...]
    ranks: tuple[tuple[Action, ...], ...]

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not re.match(r"[A-Za-z0-9_.+-]+\Z", self.name):
            raise PPError(f"program name {self.name!r} must be a word (letters, digits, _ . + -)")
        check_positive(num_microbatches=self.num_microbatches)
        object.__setattr__(self, "placement", tuple(self.placement))
        object.__setattr__(self, "ranks", tuple(tuple(r) for r in self.ranks))
        if not self.placement:
            raise PPError("a program needs at least one stage")
        for s, r in enumerate(self.placement):
            if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < len(self.ranks):
                raise PPError(f"stage {s} is placed on rank {r!r}, but the program has {len(self.ranks)} ranks")
        for r, actions in enumerate(self.ranks):
            for step, a in enumerate(actions):
                if not isinstance(a, Action):
                    raise PPError(f"rank {r}, step {step}: {a!r} is not an Action", rank=r, step=step)

    @property
    def num_ranks(self) -> int:
        return len(self.ranks)

    @property
    def num_stages(self) -> int:
        return len(self.placement)

    def rank_of(self, stage: int) -> int:
        return self.placement[stage]

    def stages_of(self, rank: int) -> tuple[int, ...]:
        return tuple(s for s, r in enumerate(self.placement) if r == rank)

    def replace(self, *, name: str | None = None, ranks: Iterable[Iterable[Action]] | None = None) -> Program:
        return Program(
            self.name if name is None else name,
            self.num_microbatches,
            self.placement,
            self.ranks if ranks is None else tuple(tuple(r) for r in ranks),
        )

    def only(self, kinds: Iterable[Kind]) -> Program:
        """The program restricted to ``kinds`` (e.g. ``COMPUTE``), order kept."""
        keep = frozenset(kinds)
        return self.replace(ranks=[[a for a in r if a.kind in keep] for r in self.ranks])

    def has_p2p(self) -> bool:
        return any(a.is_p2p for r in self.ranks for a in r)

    def to_text(self) -> str:
        return program_to_text(self)

    @staticmethod
    def from_text(text: str) -> Program:
        return program_from_text(text)


def program_to_text(program: Program) -> str:
    lines = [
        (
            f"program {program.name} microbatches={program.num_microbatches} "
            f"placement={','.join(map(str, program.placement))}"
        )
    ]
    for r, actions in enumerate(program.ranks):
        lines.append(f"rank {r}:" + "".join(f" {a}" for a in actions))
    return "\n".join(lines) + "\n"


def program_from_text(text: str) -> Program:
    """Inverse of ``program_to_text``; ``#`` starts a comment, blank lines are ignored."""
    header: tuple[str, int, tuple[int, ...]] | None = None
    ranks: list[tuple[Action, ...]] = []
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        try:
            word, _, rest = line.partition(" ")
            match word:
                case "program":
                    if header is not None:
                        raise PPError("'program' given twice")
                    header = _parse_header(rest)
                case "rank":
                    label, sep, body = rest.partition(":")
                    if not sep or label.strip() != str(len(ranks)):
                        raise PPError(f"expected 'rank {len(ranks)}:'")
                    ranks.append(act(body))
                case _:
                    raise PPError(f"unknown keyword {word!r}")
        except PPError as e:
            raise PPError(f"line {lineno}: {e} (in {raw.strip()!r})", action=e.action) from None
    if header is None:
        raise PPError("program text has no 'program' line")
    name, microbatches, placement = header
    return Program(name, microbatches, placement, tuple(ranks))


def _parse_header(rest: str) -> tuple[str, int, tuple[int, ...]]:
    name, *fields = rest.split()
    kv = dict(f.partition("=")[::2] for f in fields)
    if set(kv) != {"microbatches", "placement"}:
        raise PPError("a program line reads 'program NAME microbatches=M placement=R0,R1,...'")
    try:
        return name, int(kv["microbatches"]), tuple(int(x) for x in kv["placement"].split(","))
    except ValueError:
        raise PPError(f"bad number in {rest!r}") from None
