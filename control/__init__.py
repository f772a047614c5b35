"""The control loop: live risk scores, the policy, migrations as a persisted state machine,
and the leader election that lets one service replica act (``docs/control.md``)."""
