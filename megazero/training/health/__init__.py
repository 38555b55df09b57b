"""A run's health across ranks: where each rank is (:mod:`.phases`), a watchdog that ends a hung run
naming the ranks that did not arrive (:mod:`.watchdog`), and the straggler report (:mod:`.stragglers`)."""

from megazero.training.health.phases import PHASES, PhaseBoard, Whereabouts

__all__ = ["PHASES", "PhaseBoard", "Whereabouts"]
