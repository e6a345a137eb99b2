"""The behaviour of each kind of request leg on the scheduler side, one class each: D receiving a
prompt's KV (decode_receive.py). Each follows its legs as `Leg` objects (leg.py)."""
