"""Choosing solvers for a whole program's chains at once.

Each plan's own choice (:mod:`jaxfuse.find`) charges a candidate the longer of its device time
and its host's launch work (device time alone once the fused kernel is device-bound), which is
right for a plan run alone. In a program the host runs ahead of the device: the program takes
about the longer of the *sums*, all chains' device time against all chains' launch work. A
batch-64 network is device-bound, so a chain XLA runs faster on the device should stay XLA's
even where XLA's launches (cuDNN's host work is tens of microseconds) are longer than the fused
kernel's; a batch-1 network is launch-bound, so fused chains, one cheap launch each, win even
where XLA's kernels are a little faster.

So, per scope of :func:`jaxfuse.fuse`: start from the device-time choice (the fused kernel
where it is :data:`PROGRAM_MARGIN` faster; where the launches are at least
:data:`PROGRAM_LAUNCH_SHARE` of the device work, also where it saves more launch work than it
adds device time), and while the launches outweigh the device work, move to the fused kernel
the chain that shortens the longer sum most. Work outside the chains is the same either way
and is left out of the sums.

Finally the choice must shorten the program's estimated time (the longer sum) by
:data:`PROGRAM_MIN_GAIN` against leaving every measured chain to XLA, or every measured chain
is left to XLA: a fused call has costs in a program that no chain timed alone shows (on the
H100, 2026-11-24, two ResNet-50 1x1 chains fused at batch 64 measured 10% faster alone and ran
25 us slower in the network, where XLA computed them as cuBLAS matrix products), so a choice
that saves 1-2% on paper is as likely to lose. One exception: where the launch-share moves
(which the sums undercount, see above) are what falls short, the choice stands as long as the
device-time choice before them makes the gain and it is not estimated longer than all-XLA.

The margin is wider than a lone plan's (:data:`jaxfuse.find.MARGIN`) because in a program
XLA's composition also fuses with its neighbours, which a chain timed alone cannot show: on
the H100 (2026-11-24) the ResNet-50 stem, fused, measured 8% faster than XLA's composition
alone but ran 60 us slower in the network at batch 64, where XLA computed its batch norm and
relu inside the max-pool that follows (one pass over a 100 MB tensor fewer).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Sequence

from ..find import FUSED
from ..solvers import XLA

__all__ = ["PROGRAM_LAUNCH_SHARE", "PROGRAM_MARGIN", "PROGRAM_MIN_GAIN", "ChainCosts",
           "choose_for_program"]

# In a device-bound program a chain runs fused only if that is this much faster on the device.
PROGRAM_MARGIN = 0.10
# ... and the program's choice must be this much faster than all-XLA, or all-XLA it is.
PROGRAM_MIN_GAIN = 0.03
# A program whose chains' launch work is this share of their device work or more may be
# launch-bound (see choose_for_program). The sums leave out the program's other host work,
# about as large again: ResNet-50 fp32 at batch 8 on an H200 (2026-11-28) took 2.60 ms a call
# under plain jax.jit for 1.00 ms of device work, the 15 XLA launches its find step printed
# measuring 20-34 us each (about 1.2 ms, were all 53 chains' alike), and 1.28 ms with every
# chain fused (0.97 ms of device; those 15 chains' fused launches 3.5-8 us each).
# - On an H100 (2026-11-27) ResNet-50 bf16 at batch 8 (launch sum near the device sum) kept
#   five 3x3 chains on XLA by the margin (14.0 against 13.6 us on the device, 32.2 against
#   7.8 us of launch work) and ran 1.22 ms a call against 0.90 ms with every chain fused.
# - On the H200, ResNet-50 fp32 at batch 8 (launch sum about half the device sum, by the
#   launch work measured for its XLA chains and 3.5-8 us taken for each fused one) kept 15
#   chains on XLA that were 1-11 us slower fused on the device and 16-26 us cheaper to launch
#   (while only chains no slower on the device moved), and ran 1.57 ms a call against 1.28 ms
#   with every chain fused.
# - At batch 64 and 256 (H100, 2026-11-27), where the sums are far apart, the programs of
#   either choice ran within 3% of each other.
PROGRAM_LAUNCH_SHARE = 0.3


@dataclasses.dataclass(frozen=True)
class ChainCosts:
    """One plan of a program: how often it runs, its own choice, and its candidates' measured
    device and launch microseconds per run (empty where unmeasured: a forced solver, a failed
    candidate, a CPU)."""

    key: Hashable
    count: int
    own: str  # FUSED or XLA
    device_us: dict[str, float]
    host_us: dict[str, float]

    @property
    def measured(self) -> bool:
        return all(k in self.device_us and k in self.host_us for k in (FUSED, XLA))


def _saves_more_launch_than_device(c: ChainCosts) -> bool:
    """The fused kernel saves more launch work than it adds device time (if any)."""
    return (c.device_us[FUSED] - c.device_us[XLA]) < (c.host_us[XLA] - c.host_us[FUSED])


def choose_for_program(chains: Sequence[ChainCosts]) -> dict[Hashable, str]:
    """FUSED or XLA for each chain's key (see the module docstring); unmeasured chains keep
    their own choice."""
    choice = {c.key: c.own for c in chains}
    measured = [c for c in chains if c.measured]
    for c in measured:
        fused_wins = c.device_us[FUSED] <= (1 - PROGRAM_MARGIN) * c.device_us[XLA]
        choice[c.key] = FUSED if fused_wins else XLA

    def total(times: str, chosen: dict[Hashable, str]) -> float:
        return sum(c.count * getattr(c, times)[chosen[c.key]] for c in measured)

    def span(chosen: dict[Hashable, str]) -> float:
        return max(total("device_us", chosen), total("host_us", chosen))

    all_xla = {**choice, **{c.key: XLA for c in measured}}
    by_device = dict(choice)
    device, host = total("device_us", choice), total("host_us", choice)
    if host >= PROGRAM_LAUNCH_SHARE * device:
        # The sums leave out the program's host work outside its chains (JAX's dispatch of
        # its arguments, XLA's other launches, about as much again), so such a program is
        # launch-bound: a chain whose fused kernel saves more launch work than it adds device
        # time runs fused.
        for c in measured:
            if choice[c.key] == XLA and _saves_more_launch_than_device(c):
                choice[c.key] = FUSED
        device, host = total("device_us", choice), total("host_us", choice)
    while host > device:
        best, best_span = None, host
        for c in measured:
            if choice[c.key] != XLA:
                continue
            d = device + c.count * (c.device_us[FUSED] - c.device_us[XLA])
            h = host + c.count * (c.host_us[FUSED] - c.host_us[XLA])
            if max(d, h) < best_span:
                best, best_span = c, max(d, h)
        if best is None:
            break
        choice[best.key] = FUSED
        device, host = total("device_us", choice), total("host_us", choice)
    # The launch-share moves add device time to save launch work the sums undercount, which
    # the estimate cannot credit: there the device-time choice before them may carry the
    # gain, as long as the final choice is not estimated longer than all-XLA.
    bound = (1 - PROGRAM_MIN_GAIN) * span(all_xla)
    if span(choice) > bound and not (span(by_device) <= bound
                                     and span(choice) <= span(all_xla)):
        return all_xla
    return choice
