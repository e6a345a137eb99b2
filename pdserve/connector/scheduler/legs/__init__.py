"""The behaviour of each kind of request leg on the scheduler side, one class each: P sending a
prompt's KV (prefill_send.py, WRITE), P holding it for D to read (prefill_hold.py, READ), D
receiving it or computing the prompt itself (decode_receive.py). Each follows its legs as `Leg`
objects (base.py), whose status moves only along base.py's transitions."""
