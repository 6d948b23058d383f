"""pipeline_parallel's engine: DeepSpeed's pipeline API built on the textbook schedules and executor
(ds_pipe.py initialize → pipe_engine.py PipelineEngine → draining.py, the textbook Executor guarded);
each file's docstring says its part.
"""
