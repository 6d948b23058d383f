"""pipeline_parallel's engine: DeepSpeed's pipeline API built on the textbook schedules and executor.

pipe_engine.py (initialize, PipelineEngine), draining.py (the textbook Executor, guarded),
module.py (PipelineModule, an nn.Module) and layers.py (LayerSpec, TiedLayerSpec, stage chunks),
topology.py and ds_pipe.py (deepspeed.pipe's names and initialize), deepspeed_engine.py (DeepSpeed's
own engine, the reference), optim.py (Adam/AdamW, Lion), tied.py, config.py, simulator.py and
nccl_order.py (schedules checked and ordered without processes), model.py (the byte-level GPT the
demo trains), reviews.py (the demo's text).
"""
