"""pipeline_parallel's engine: DeepSpeed's pipeline API built on the textbook schedules and executor.

pipe_engine.py (initialize, PipelineEngine), draining.py (the textbook Executor, guarded),
module.py (PipelineModule, LayerSpec, TiedLayerSpec), tied.py, config.py, simulator.py and
nccl_order.py (schedules checked and ordered without processes), timeline.py, model.py (the
byte-level GPT the demo trains), reviews.py (the demo's text).
"""
