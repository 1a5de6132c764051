"""What a person reads: the run's HTML report and its verdict (report, with templates/)."""
