"""Small dependency-free helpers for the command-line tools: PNG line plots and progress output."""
