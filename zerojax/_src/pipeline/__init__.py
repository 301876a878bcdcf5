"""Pipeline stages over a mesh axis: the ``timetable`` of a schedule, one ``stage``'s program, and
the ``loop`` that runs micro-batches through them (``zerojax.pipeline``)."""
