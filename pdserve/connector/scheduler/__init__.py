"""The connector's scheduler side: what runs in vLLM's scheduler (EngineCore) process.

It sees vLLM's `Request` objects and block ids and tells the worker side what to do through a
`StepPlan` (connector/metadata.py) once per step. Free of vLLM's imports.
"""
