"""Chapter 1, the reference: one process trains on the whole global batch. No communication.

    python ddp_examples/01_single_process.py
    torchrun --standalone --nproc_per_node 2 ddp_examples/01_single_process.py   (each rank repeats it)

Every later chapter must end with these parameters, up to float32 rounding.
"""
from ddp_examples.engine.common import main


def wrap(model, cfg):
    return model          # nothing to add: this is the baseline


if __name__ == "__main__":
    main(wrap, "chapter 1: single process", single_process=True)
