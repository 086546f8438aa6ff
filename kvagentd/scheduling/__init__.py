"""The job scheduler's side of the daemon: cron text as triggers (`cron`), what each job did
(`jobwatch`), the listener of job events (`jobevents`) and job listing and control (`jobs`)."""
