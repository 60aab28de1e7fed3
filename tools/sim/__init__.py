"""The discrete-event simulator behind ``tools/simulate.py``.

It drives the conductor's own policies (``mooncaked.conductor.policies``), prefix index and
cost models against simulated prefill and decode instances whose step times come from a
profile, so a whole trace replays in seconds.
"""
