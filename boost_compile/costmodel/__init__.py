"""The cost model: hardware files, the scale model of a training iteration, and the analytic
formulas and published figures it is checked against.

Below both of its users: ``boost_compile.plan`` (the layout planner) prices layouts with it,
and ``boost_compile.bench`` (boost-bench) measures against it; it imports neither.
"""
