"""The measured diagnosis of a vibration window: a fault in a fixed vocabulary, its severity,
confidence and evidence (spectral lines, ISO zone, baseline, trends).

Modules: `spectra` (spectra and the significance test), `bearing` (envelope signatures),
`shaft` (speed check and running-speed faults), `analysis` (one window top-down), `result`
(the `Diagnosis`), `baseline` (a machine's learned normal), `trend` (hour and day trends).
"""
