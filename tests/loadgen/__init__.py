"""Tests for the load-testing package."""
