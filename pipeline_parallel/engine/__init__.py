"""pipeline_parallel's engine: DeepSpeed's pipeline API around the textbook schedules and executor.

pipe_engine.py (initialize, PipelineEngine), module.py (PipelineModule, LayerSpec, TiedLayerSpec),
tied.py, config.py, timeline.py, model.py (the byte-level GPT the demo trains).
"""
