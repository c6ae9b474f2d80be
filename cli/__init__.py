"""The `duet` command: one module per subcommand (serve, generate, chat, bench, tokenizer), the
engine flags generated from `EngineConfig` (engine_flags), and the `ray job submit` entry
point (ray_job). docs/cli.md describes every flag."""
