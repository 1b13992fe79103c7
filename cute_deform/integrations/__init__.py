"""Integrations of cute_deform into other libraries' models (`cute_deform.integrations.transformers`)."""
