"""Configuration and planning: the settings tree, what each key reruns, the config checks, the plan."""
