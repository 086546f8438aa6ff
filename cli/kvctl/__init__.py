"""kvctl: the operator command line for kvagentd."""
