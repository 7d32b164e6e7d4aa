"""What an objective's run reports, declared by the objective (`Objective.reporting`): its held-out measures (the
first is its headline), which way each improves, what they are taken on, and the curves of its training. The run
folder's plot and closing figures, the trainer's last lines, the model card and the studio ask it; none of them
names a metric."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Measure:
    """One figure of metrics.jsonl: its key, how a sentence names it, which way it improves."""

    key: str
    name: str
    higher_is_better: bool
    digits: int = 4
    charted: bool = True  # drawn with the other held-out measures (a perplexity's scale is the loss's exponential)

    def said(self, value: float) -> str:
        return f"**{value:.{self.digits}f}**"


@dataclass(frozen=True)
class Reporting:
    """An objective's reporting. held_out: its eval measures, the headline first; taken_on: what they are taken on
    (a card says "on held-out pairs"); curves: the training figures drawn beside the loss (a second panel), each with
    its held-out counterpart where there is one; loss_unit: what the loss is averaged over."""

    held_out: tuple[Measure, ...]
    taken_on: str
    curves: tuple[str, ...] = ()
    loss_unit: str = "per target token"

    @property
    def headline(self) -> Measure:
        return self.held_out[0]

    def panel(self) -> tuple[str, ...]:
        """The second panel's keys: each training curve, then the held-out measures of the same figures."""
        return (*self.curves, *(m.key for m in self.held_out if m.key.removeprefix("eval_") in self.curves))

    def results(self, last: dict, start: dict) -> str | None:
        """A card's Results sentence from the last eval record and the step-0 one (the base model's), or None when
        the last holds no headline: the headline before and after, then the other measures."""
        headline = self.headline
        if headline.key not in last:
            return None
        before = f"{headline.said(start[headline.key])} before training -> " if headline.key in start else ""
        others = [f"{m.name} {m.said(last[m.key])}" for m in self.held_out[1:] if m.key in last]
        return (
            f"{headline.name[0].upper()}{headline.name[1:]} {before}{headline.said(last[headline.key])}"
            f" (step {last['step']}){''.join(', ' + o for o in others)}, on {self.taken_on}."
        )


LOSS = Measure("eval_loss", "eval loss", higher_is_better=False)
