"""deepspeed.utils.zero_to_fp32 under the runner: the engine's functions (engine/zero_to_fp32.py),
which read our checkpoints and DeepSpeed's.

    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint   (under the runner)
    sd = get_fp32_state_dict_from_zero_checkpoint("ckpt")            # tag from ckpt/latest
    convert_zero_checkpoint_to_fp32_state_dict("ckpt", "out")        # out/pytorch_model.bin (+ shards, index)
    model = load_state_dict_from_zero_checkpoint(model, "ckpt")      # model.cpu(), loaded, strict=False
"""
from zero_from_scratch.engine.zero_to_fp32 import (convert_zero_checkpoint_to_fp32_state_dict,  # noqa: F401
                                                   convert_zero_checkpoint_to_state_dict,
                                                   get_fp32_state_dict_from_zero_checkpoint,
                                                   load_state_dict_from_zero_checkpoint)
from zero_from_scratch.as_deepspeed.more_zero_files import (get_checkpoint_files, get_model_state_files,  # noqa: F401
                                                            get_optim_files)

__all__ = ["get_fp32_state_dict_from_zero_checkpoint", "convert_zero_checkpoint_to_fp32_state_dict",
           "convert_zero_checkpoint_to_state_dict", "load_state_dict_from_zero_checkpoint", "get_checkpoint_files",
           "get_optim_files", "get_model_state_files"]
