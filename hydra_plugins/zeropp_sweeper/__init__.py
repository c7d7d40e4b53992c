"""``hydra/sweeper=zeropp`` (the runner's default sweeper): Hydra's basic sweeper that checks every
point of a sweep before the first one starts.

Hydra's basic sweeper composes each point's config before launching a batch (so a group option
that does not exist fails at once), but the runner validates a point's settings only when that
point's turn comes: a sweep whose fifth point cannot work (a bucket size that does not divide, a
topology this host cannot start) used to run four points first, or, on Slurm, submit them. This
sweeper hands every composed point to the runner's ``check_sweep_points`` (found through the task
function's own module, as the Slurm launcher finds the runner: ``python -m experiments.run`` runs it
as ``__main__``), which names each invalid point and exits 2 before any starts. A task function
without that hook (another Hydra app in this environment) gets the basic sweeper unchanged.

Hydra instantiates only sweeper classes defined under its ``hydra_plugins`` namespace package,
hence this module; importing it stores ``hydra/sweeper: zeropp`` in Hydra's config store, and the
runner registers the class with Hydra wherever it is installed (``experiments/runner/plugins.py``).
"""

import sys
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.config_store import ConfigStore
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig

CHECK_HOOK = "check_sweep_points"
"""The function of the task's module that checks the composed points: ``hook(points)``, each point
``(overrides, composed config)``; it exits the command itself when one is invalid."""


@dataclass
class ZeroppSweeperConf:
    """The basic sweeper's settings (``max_batch_size``: points launched together, None: all;
    ``params``: the sweep's key -> values), for the sweeper below."""

    _target_: str = "hydra_plugins.zeropp_sweeper.ZeroppSweeper"
    max_batch_size: Optional[int] = None
    params: Optional[Dict[str, str]] = None


ConfigStore.instance().store(group="hydra/sweeper", name="zeropp", node=ZeroppSweeperConf, provider="zeropp")


class ZeroppSweeper(BasicSweeper):
    """Hydra's basic sweeper; every point of the sweep (of all batches, when ``max_batch_size``
    splits it) is checked by the task's :data:`CHECK_HOOK` in :meth:`sweep`, before the sweep directory is made."""

    def __init__(self, max_batch_size: Optional[int], params: Optional[Dict[str, str]] = None) -> None:
        # Hydra's basic sweeper asserts max_batch_size > 0 only when it splits the sweep (a traceback)
        if max_batch_size is not None and (isinstance(max_batch_size, bool) or max_batch_size < 1):
            print(
                f"error: invalid config: hydra.sweeper.max_batch_size={max_batch_size}; allowed: the number of "
                "points launched together, >= 1, or null (all of them); nothing was started",
                file=sys.stderr,
                flush=True,
            )
            sys.exit(2)
        super().__init__(max_batch_size=max_batch_size, params=params)

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        super().setup(hydra_context=hydra_context, task_function=task_function, config=config)
        module = sys.modules.get(getattr(task_function, "__module__", ""))
        self.check_points: Optional[Callable[[list[tuple[list[str], DictConfig]]], Any]] = getattr(
            module, CHECK_HOOK, None
        )

    def sweep(self, arguments: List[str]) -> Any:
        """Check every point first, then sweep as the basic sweeper does: the check runs before
        Hydra's sweeper creates the sweep directory and writes its ``multirun.yaml`` (a refused
        sweep into an earlier sweep's directory leaves that sweep's record as it was)."""
        if self.check_points is not None:
            assert self.hydra_context is not None and self.config is not None
            parser = OverridesParser.create(config_loader=self.hydra_context.config_loader)
            preset = self._parse_config()
            self._note_replaced_axes(parser.parse_overrides(preset), parser.parse_overrides(list(arguments)))
            parsed = parser.parse_overrides([*preset, *arguments])
            points = [list(o) for batch in self.split_arguments(parsed, None) for o in batch]
            loader = self.hydra_context.config_loader
            self.check_points([(o, loader.load_sweep_config(self.config, o)) for o in points])
        return super().sweep(arguments)

    @staticmethod
    def _note_replaced_axes(preset: Sequence[Override], given: Sequence[Override]) -> None:
        """Say so when the command line sets a key the sweep's ``params`` (a ``sweep=`` preset)
        sweeps: Hydra lets the command line win, so that axis collapses to the given value(s)
        (``sweep=ablation quant=hpz`` runs one point, not the preset's five), which is what the user
        may want, but should not learn from the point count alone. Keys are matched as Hydra's
        sweeper merges them (``get_key_element``: with a ``+``/``++``/``~`` prefix and an
        ``@package``), so ``~quant`` or ``quant@x=...`` are not taken for a replacement."""
        swept = {o.get_key_element(): o for o in preset if o.is_sweep_override()}
        for o in given:
            was = swept.get(o.get_key_element())
            if was is not None:
                print(
                    f"zeropp: {o.input_line} replaces the sweep's {was.input_line} (the command line wins); "
                    f"to sweep the preset's values, drop {o.key_or_group} from the command line",
                    file=sys.stderr,
                    flush=True,
                )

    def validate_batch_is_legal(self, batch: Sequence[Sequence[str]]) -> None:
        if self.check_points is None:
            super().validate_batch_is_legal(batch)
        # else every point of every batch was composed and checked in sweep(), before the first batch
