"""What a run prints: only what a user should read.

Messages of our own are fixed where they arise. What other libraries print and we cannot change at its
source is silenced here, each with the one line that says why it is harmless; ``trainer`` commands call
:func:`quiet_libraries` once at start.
"""

from __future__ import annotations

import logging
import warnings

from lightning.pytorch.callbacks import RichProgressBar
from lightning.pytorch.utilities.warnings import PossibleUserWarning
from transformers.utils import logging as hf_logging


def quiet_libraries() -> None:
    # The frozen target is in eval mode on purpose (it never trains; dropout stays off): Lightning counts its
    # modules and warns at every fit start.
    warnings.filterwarnings("ignore", r"Found \d+ module\(s\) in eval mode", PossibleUserWarning)
    # Lightning's own pytree helper calls torch's deprecated LeafSpec check; inside Lightning, no effect on us.
    warnings.filterwarnings("ignore", r"`isinstance\(treespec, LeafSpec\)` is deprecated")
    # transformers draws a bar per checkpoint load and save; the tiny checkpoints take a blink, and the run's
    # own progress bar reports the run.
    hf_logging.disable_progress_bar()
    # Lightning advertises its cloud logger at every fit start: nothing for a user of this toolkit to act on.
    logging.getLogger("lightning.pytorch.utilities.rank_zero").addFilter(_not_an_advert)


def _not_an_advert(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith("💡 Tip")


class StepProgressBar(RichProgressBar):
    """Lightning's rich progress bar, whose title reads "Epoch 0/-2" in a run bounded by steps (Lightning sets
    ``max_epochs = -1`` there); such a run's title is the epoch alone."""

    def _get_train_description(self, current_epoch: int) -> str:
        description = super()._get_train_description(current_epoch)
        max_epochs = self.trainer.max_epochs
        if max_epochs is not None and max_epochs < 0:
            description = description.replace(f"/{max_epochs - 1}", "", 1).ljust(len(description))
        return description
