"""pipeline_parallel's engine: DeepSpeed's pipeline API built on the textbook schedules and executor.

ds_pipe.py (initialize, deepspeed.pipe's names), pipe_engine.py (PipelineEngine), draining.py (the
textbook Executor, guarded), step.py (norm, clipping, fp32 masters, loss scale, the step report),
zero1.py (ZeRO-1 over the data axis), config.py (DeepSpeed's JSON, its key table, the optimizer),
checkpoint.py (DeepSpeed's pipeline layout), module.py (PipelineModule, an nn.Module) and layers.py
(LayerSpec, TiedLayerSpec, stage chunks, tied weights), topology.py and ds_schedule.py (DeepSpeed's
topologies and schedule classes), simulator.py (schedules checked and ordered for nccl without
processes), deepspeed_engine.py (DeepSpeed's own engine, the reference), model.py (the GPT the demo trains).
"""
